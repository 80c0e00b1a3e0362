"""What the tests, the benchmarks and `python -m megatron_tma --check` compare against, kept apart from the numerics
oracle (megatron_tma.reference) that the package itself runs on the CPU:
* `m_grouped_ref64`, `k_grouped_ref64`: the GEMMs in float64 from the dequantized operands (the accuracy reference);
* `diff`: docs/design.md §3's similarity metric;
* `pad_groups_rows`: the host-side padded twin's input (every group padded with zero rows to a multiple of align),
  whose results `reference.unpad_rows` brings back.
"""
from typing import Optional

import torch

from . import groups as _groups
from .reference import (FP8, _cdiv, _group_rows, _padded_row_index, alloc_1x128_scales, dequantize_1x128,
                        dequantize_128x128, dequantize_grouped_128x1)

__all__ = ["m_grouped_ref64", "k_grouped_ref64", "diff", "pad_groups_rows"]


def m_grouped_ref64(a, a_s, b, b_s, groups) -> torch.Tensor:
    """float64 A_g . B_g^T from the dequantized operands (the accuracy reference, [M, N])."""
    M = a.shape[0]
    a64 = dequantize_1x128(a, a_s, torch.float64)
    b64 = dequantize_128x128(b, b_s, torch.float64)
    sizes = _groups.host_group_sizes(groups, b.shape[0], M)
    out = torch.zeros(M, b.shape[1], dtype=torch.float64, device=a.device)
    for g, r0, r1 in _group_rows(sizes):
        out[r0:r1] = a64[r0:r1] @ b64[g].t()
    return out


def k_grouped_ref64(dy_t, dy_s, x_t, x_s, groups, *, num_groups: Optional[int] = None) -> torch.Tensor:
    """float64 dY_g^T . X_g from the dequantized operands (the accuracy reference, [G, N, K]). G as in
    k_grouped_fp8_gemm without out: ``num_groups``, else the length of ``groups`` (sizes)."""
    dy64 = dequantize_grouped_128x1(dy_t, dy_s, groups, torch.float64, num_groups=num_groups)
    x64 = dequantize_grouped_128x1(x_t, x_s, groups, torch.float64, num_groups=num_groups)
    sizes = _groups.host_group_sizes(groups, num_groups)
    out = torch.zeros(len(sizes), dy64.shape[1], x64.shape[1], dtype=torch.float64, device=dy_t.device)
    for g, r0, r1 in _group_rows(sizes):
        out[g] = dy64[r0:r1].t() @ x64[r0:r1]
    return out


def diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """docs/design.md §3 similarity: 1 - 2<x,y> / (<x,x> + <y,y>) in float64. 0 when equal, NaN if either
    holds NaN or both are all zero (a comparison against a tolerance then fails, as it must)."""
    if x.shape != y.shape:
        raise ValueError(f"diff: shapes differ, {tuple(x.shape)} vs {tuple(y.shape)}")
    # in slices of the flattened tensors: a layer's FP32 weight gradient (~1e9 elements at DeepSeek-V3's 32 experts)
    # in float64 would be 8 GB a copy, several of them at once
    x, y = x.reshape(-1), y.reshape(-1)
    xx = yy = xy = 0.0
    for start in range(0, max(x.numel(), 1), _DIFF_SLICE):
        a, b = x[start:start + _DIFF_SLICE].to(torch.float64), y[start:start + _DIFF_SLICE].to(torch.float64)
        xx, yy, xy = xx + (a * a).sum(), yy + (b * b).sum(), xy + (a * b).sum()
    return float(1.0 - 2.0 * xy / (xx + yy))


_DIFF_SLICE = 1 << 26  # elements: 512 MB of float64 a slice


def pad_groups_rows(
    a: torch.Tensor,
    a_s: Optional[torch.Tensor],
    groups: torch.Tensor,
    align: int,
    num_groups: Optional[int] = None,
):
    """Pad every group of rows of ``a`` with zero rows to a multiple of ``align``.

    Returns (a_pad, a_s_pad, padded sizes int64 [G] on groups' device). ``a`` may be any dtype
    (e4m3 data, or unquantized rows to quantize afterwards); ``a_s`` (1x128 scales, or None) gets
    scale 1.0 on padding rows, which is what quantizing a zero row gives.
    """
    M = a.shape[0]
    sizes = _groups.host_group_sizes(groups, num_groups, M, device=a.device)
    padded = [_cdiv(m, align) * align for m in sizes]
    dest = _padded_row_index(sizes, align, a.device)
    raw = a.view(torch.uint8) if a.dtype == FP8 else a
    out = torch.zeros((sum(padded),) + tuple(a.shape[1:]), dtype=raw.dtype, device=a.device)
    out[dest] = raw
    a_pad = out.view(FP8) if a.dtype == FP8 else out
    a_s_pad = None
    if a_s is not None:
        a_s_pad = alloc_1x128_scales(sum(padded), a_s.shape[1], a.device)
        a_s_pad[dest] = a_s
    return a_pad, a_s_pad, torch.tensor(padded, dtype=torch.int64, device=groups.device)
