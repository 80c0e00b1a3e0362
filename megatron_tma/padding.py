"""The padded path: the baseline that the unpadded GEMM replaces (docs/design.md §5).

Pad each group of FP8 rows (and their 1x128 scales) to a multiple of `align` rows, run an M-grouped GEMM on
the padded layout, drop the padding rows of the output. Group g of the padded layout owns rows
``[P_g, P_g + round_up(M_g, align))`` with ``P_g = sum_{h<g} round_up(M_h, align)`` (an empty group owns
none); its first M_g rows are the group's rows, the rest are zero data with scale 1.0. Zero rows contribute
exact zeros to a GEMM, so the valid output rows equal the unpadded GEMM's bit for bit (docs/design.md §3).

The padded total depends on the device group sizes, so nothing here reads it on the host: the padded
buffers have `padded_row_count_upper_bound(M, G, align)` rows, the rows from the real padded total to that
bound are zero data with scale 1.0 as well, and the padded offsets come back as a device int32 [G+1] tensor
(``offsets[G]`` is the real padded total, which may be below the buffer's row count; a GEMM given these
offsets leaves its output rows past ``offsets[G]`` alone, and they are never un-padded).

`pad_rows_fp8` and `unpad_rows` are one op each (``torch.ops.megatron_tma.pad_rows_fp8`` / ``unpad_rows_bf16``,
megatron_tma.ops): on a GPU one gather kernel each, no host read, CUDA-graph capturable; on the CPU the torch
reference (`megatron_tma.reference`; `pad_rows_fp8_reference` and `unpad_rows_reference` run it on any device),
which reads the group sizes on the host, rejects sizes that do not describe M rows, and writes the same bytes as the
kernels. The kernels cannot check the sizes without a host read; they clamp them to the buffers (never an
out-of-bounds access), and rows of `unpad_rows`' output that no group covers are written as zeros.
"""
from typing import Callable, Optional, Tuple

import torch

from . import ops
from . import reference as R
from ._validate import FP8, check_same_device, check_tensor
from .groups import check_groups, padded_row_count_upper_bound

__all__ = [
    "padded_row_count_upper_bound",
    "pad_rows_fp8",
    "unpad_rows",
    "padded_m_grouped_fp8_gemm",
    "pad_rows_fp8_reference",
    "unpad_rows_reference",
]


# --------------------------------------------------------------------------------------------------------
# Argument checks (one wording for the kernels and the reference; group checks are megatron_tma.groups')
# --------------------------------------------------------------------------------------------------------


def _check_align(align) -> None:
    if not isinstance(align, int) or isinstance(align, bool) or align < 16 or align % 16 != 0:
        raise ValueError(
            f"align must be a positive multiple of 16 (128: DeepGEMM, 16: Transformer Engine), got {align!r}"
        )


def _check_pad_args(a, a_scales, groups, align, num_groups: Optional[int]) -> Tuple[torch.Tensor, int]:
    """Validates the pad arguments; returns (groups, G)."""
    check_tensor(a, "a", (FP8,), dim=2)
    m, k = a.shape
    if k % 16 != 0:
        raise ValueError(f"K must be a multiple of 16 (rows are copied as 16-byte vectors), got K={k}")
    kb = (k + 127) // 128
    check_tensor(a_scales, "a_scales", (torch.float32,), dim=2, contiguous=False)
    if tuple(a_scales.shape) != (m, kb):
        raise ValueError(f"a_scales must have shape [M, ceil(K/128)] = [{m}, {kb}], got {tuple(a_scales.shape)}")
    if (m > 1 and a_scales.stride(0) != 1) or (kb > 1 and a_scales.stride(1) < m):
        raise ValueError(
            "a_scales must be M-contiguous, the 1x128 layout of docs/layouts.md (storage [ceil(K/128), "
            f"ceil(M/4)*4] viewed transposed, strides (1, ceil(M/4)*4)), got strides {a_scales.stride()}"
        )
    check_same_device(a=a, a_scales=a_scales)
    _check_align(align)
    groups = check_groups(groups, num_groups, m, device=a.device)
    return groups.tensor, groups.num_groups


def _check_unpad_args(y_pad, groups, padded_offsets, m_total, out) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Validates the un-pad arguments; returns (groups, padded_offsets, G)."""
    check_tensor(y_pad, "y_pad", (torch.bfloat16,), dim=2)
    n = y_pad.shape[1]
    if n == 0 or n % 8 != 0:
        raise ValueError(f"N must be a positive multiple of 8 (rows are copied as 16-byte vectors), got N={n}")
    if not isinstance(m_total, int) or isinstance(m_total, bool) or m_total < 0:
        raise ValueError(f"m_total must be an int >= 0, got {m_total!r}")
    check_tensor(padded_offsets, "padded_offsets", (torch.int32,), dim=1)
    if padded_offsets.numel() < 2:
        raise ValueError(f"padded_offsets must hold G+1 >= 2 entries, got {padded_offsets.numel()}")
    num_groups = padded_offsets.numel() - 1
    padded_offsets = check_groups(padded_offsets, num_groups, device=y_pad.device, name="padded_offsets").tensor
    groups = check_groups(groups, num_groups, m_total, device=y_pad.device).tensor
    if out is not None:
        check_tensor(out, "out", (torch.bfloat16,), dim=2, device=y_pad.device)
        if tuple(out.shape) != (m_total, n):
            raise ValueError(f"out must have shape [m_total, N] = [{m_total}, {n}], got {tuple(out.shape)}")
        if _overlap(out, y_pad):
            raise ValueError("out must not overlap y_pad")
    return groups, padded_offsets, num_groups


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes."""
    if x.numel() == 0 or y.numel() == 0 or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    x0, y0 = x.storage_offset() * x.element_size(), y.storage_offset() * y.element_size()
    return x0 < y0 + y.numel() * y.element_size() and y0 < x0 + x.numel() * x.element_size()


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def pad_rows_fp8(
    a: torch.Tensor, a_scales: torch.Tensor, groups: torch.Tensor, align: int = 128, *, num_groups: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad every group of rows of `a` (and its 1x128 scales) to a multiple of `align` rows.

    Args:
        a: float8_e4m3fn [M, K], contiguous, K a multiple of 16.
        a_scales: float32 [M, ceil(K/128)] in the M-contiguous layout of docs/layouts.md.
        groups: int32/int64 device tensor, sizes [G] or offsets [G+1].
        align: a multiple of 16 (128 for DeepGEMM-style 128-row tiles, 16 for Transformer Engine).
        num_groups: G. Leave it out when `groups` holds sizes; pass it to give offsets [G+1].

    Returns:
        (a_pad, a_scales_pad, padded_offsets): a_pad float8_e4m3fn [M_pad, K]; a_scales_pad float32
        [M_pad, ceil(K/128)] in the same M-contiguous layout (storage [ceil(K/128), M_pad]); padded_offsets
        int32 [G+1] on the device. ``M_pad = padded_row_count_upper_bound(M, G, align)``; padding rows and rows
        past ``padded_offsets[G]`` are zeros with scale 1.0.
    """
    groups, num_groups = _check_pad_args(a, a_scales, groups, align, num_groups)
    return ops.kernel("pad_rows_fp8")(a, a_scales, groups, num_groups, align)


def unpad_rows(
    y_pad: torch.Tensor,
    groups: torch.Tensor,
    padded_offsets: torch.Tensor,
    m_total: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gather the valid rows of a padded BF16 output: ``out[O_g + r] = y_pad[P_g + r]`` for r < M_g.

    Args:
        y_pad: bfloat16 [M_pad, N], contiguous, N a multiple of 8 (e.g. the GEMM output over `pad_rows_fp8`'s
            layout).
        groups: the same sizes [G] / offsets [G+1] that were padded.
        padded_offsets: the int32 [G+1] offsets `pad_rows_fp8` returned.
        m_total: M, the number of unpadded rows (sum of the group sizes; a host int, e.g. ``a.shape[0]``).
        out: optional bfloat16 [M, N] contiguous destination, not overlapping y_pad.
    """
    groups, padded_offsets, _ = _check_unpad_args(y_pad, groups, padded_offsets, m_total, out)
    if out is None:
        out = y_pad.new_empty((m_total, y_pad.shape[1]))
    ops.kernel("unpad_rows_bf16")(y_pad, groups, padded_offsets, out)
    return out


def padded_m_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    groups: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    gemm: Optional[Callable[..., torch.Tensor]] = None,
    *,
    align: int = 128,
) -> torch.Tensor:
    """The padded path: pad, run an M-grouped GEMM on the padded layout, un-pad. Returns bf16 [M, N].

    Same arguments as `megatron_tma.gemm.m_grouped_fp8_gemm` (b: float8_e4m3fn [G, N, K], b_scales float32
    [G, ceil(N/128), K/128], groups sizes [G] or offsets [G+1]). `gemm(a, a_scales, b, b_scales, groups)` is
    the GEMM to run on the padded layout (default: `megatron_tma.gemm.m_grouped_fp8_gemm`); it receives the
    padded offsets as its groups and must return bf16 [rows of a_pad, N]. On the CUDA path a_pad has the
    bound's rows and ``offsets[G]`` may be below that: the GEMM must leave rows past ``offsets[G]`` alone
    (they are zeros with scale 1.0, and never un-padded).
    """
    check_tensor(b, "b", (FP8,), dim=3)
    a_pad, a_scales_pad, padded_offsets = pad_rows_fp8(a, a_scales, groups, align, num_groups=b.shape[0])
    if ops.reference_runs_on(a.device):
        # The reference reads sizes on the host anyway: give the GEMM exactly the real padded rows,
        # so that its host value check (offsets[G] == rows) holds there. The kernel path keeps the bound.
        rows = int(padded_offsets[-1])
        a_pad, a_scales_pad = a_pad[:rows], a_scales_pad[:rows]
    if gemm is None:
        from .gemm import m_grouped_fp8_gemm as gemm  # lazy: the GEMM module imports the extension
    y_pad = gemm(a_pad, a_scales_pad, b, b_scales, padded_offsets)
    return unpad_rows(y_pad, groups, padded_offsets, a.shape[0], out=out)


# --------------------------------------------------------------------------------------------------------
# Torch reference (any device; reads the group sizes on the host)
# --------------------------------------------------------------------------------------------------------


def pad_rows_fp8_reference(
    a: torch.Tensor, a_scales: torch.Tensor, groups: torch.Tensor, align: int = 128, *, num_groups: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pad_rows_fp8` in plain torch: the same outputs, byte for byte."""
    groups, num_groups = _check_pad_args(a, a_scales, groups, align, num_groups)
    return R.pad_rows_fp8(a, a_scales, groups, num_groups, align)


def unpad_rows_reference(
    y_pad: torch.Tensor,
    groups: torch.Tensor,
    padded_offsets: torch.Tensor,
    m_total: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`unpad_rows` in plain torch: the same output, byte for byte."""
    groups, padded_offsets, _ = _check_unpad_args(y_pad, groups, padded_offsets, m_total, out)
    if out is None:
        out = y_pad.new_empty((m_total, y_pad.shape[1]))
    return R.unpad_rows_bf16(y_pad, groups, padded_offsets, out)
