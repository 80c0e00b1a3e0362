"""FP8 grouped GEMMs without padding (docs/design.md §2-§4).

`m_grouped_fp8_gemm` runs forward (`b` = W `[G, N, K]`) and dgrad (`b` = the W^T copy `[G, K, N]`) with the
same call: rows of `a` are split into G groups of any size (0 included) by a device tensor of sizes or
offsets that is never read on the host. Both GEMMs are torch ops (megatron_tma.ops): on GPU tensors the
TMA-adaptive kernels (csrc/include/megatron_tma/kernels/), on the CPU the plain-torch oracle of
`megatron_tma.reference` (same numerics contract, not bit-identical to tensor cores).
"""
from typing import Optional

import torch

from . import _ext, ops
from ._validate import FP8, any_misaligned16, check_aligned16, check_same_device, check_tensor
from .groups import (Groups, check_groups, check_wgrad_columns, check_wgrad_tokens, debug_checks_enabled, groups_name,
                     max_tiles, wgrad_pitch)
from .limits import K_GROUPED_MAX_GROUPS, M_GROUPED_MAX_GROUPS, check_num_groups

__all__ = ["m_grouped_fp8_gemm", "k_grouped_fp8_gemm", "run_m_grouped", "run_k_grouped"]

# The argument rules live here, once, and run on every call on every backend (so code tested on the CPU runs on the
# GPU), with the errors users see (TypeError / ValueError naming the argument). The C++ ops check the same
# preconditions again (csrc/binding/): they are torch ops that compiled graphs call without this Python, and a kernel
# must not read out of bounds whoever calls it. tests/test_gemm_op_preconditions_gpu.py holds the two together.
# A `Groups` from `check_groups` is taken as checked (matched to the call's G and rows only). The autograd Functions
# check their own arguments once at entry and then run `run_m_grouped` / `run_k_grouped` (and quant's `run_*`) on
# operands they made themselves, which no rule needs to see again.


def _check_m_grouped_args(a, a_scales, b, b_scales, groups, out, block_n, block_m):
    """The forward/dgrad rules of docs/design.md §4; returns (Groups, device, M, N)."""
    check_tensor(a, "a", (FP8,), dim=2)
    check_tensor(b, "b", (FP8,), dim=3)
    check_tensor(b_scales, "b_scales", (torch.float32,), dim=3)
    check_tensor(a_scales, "a_scales", (torch.float32,), dim=2, contiguous=False)
    m, k = a.shape
    g, n, kb = b.shape
    if kb != k:
        raise ValueError(f"a is [M, K] = {list(a.shape)} but b is [G, N, K] = {list(b.shape)}: K differs")
    if k == 0 or k % 128 != 0:
        raise ValueError(f"K must be a positive multiple of 128 (the FP8 scaling block), got K={k}")
    if n == 0 or n % 16 != 0:
        raise ValueError(f"N must be a positive multiple of 16, got N={n}")
    if g < 1:
        raise ValueError("b must hold at least one group (G >= 1)")
    if g > M_GROUPED_MAX_GROUPS:
        check_num_groups(g, "M_GROUPED_MAX_GROUPS", "m_grouped_fp8_gemm")
    if a_scales.shape != (m, k // 128):
        raise ValueError(f"a_scales must be [M, K/128] = {[m, k // 128]}, got {list(a_scales.shape)}")
    ld = a_scales.stride(1)
    if m > 1 and a_scales.stride(0) != 1:
        raise ValueError(
            "a_scales must be the M-contiguous view returned by quantize_1x128 (stride (1, ld)), "
            f"got strides {a_scales.stride()}"
        )
    # (also with one K block: the TMA descriptor of a_scales has the pitch as its stride, as the op checks)
    if m > 0 and (ld < m or ld % 4 != 0):
        raise ValueError(f"a_scales' row pitch must be >= M and a multiple of 4, got {ld}")
    if b_scales.shape != (g, (n + 127) // 128, k // 128):
        raise ValueError(
            f"b_scales must be [G, ceil(N/128), K/128] = {[g, (n + 127) // 128, k // 128]}, got {list(b_scales.shape)}"
        )
    if block_n not in (0, 128, 192, 256):
        raise ValueError(f"block_n must be 0 (auto), 128, 192 or 256, got {block_n!r}")
    if block_m not in (0, 128, 192):
        raise ValueError(f"block_m must be 0 (auto), 128 or 192, got {block_m!r}")
    if block_m == 192 and block_n not in (0, 128):
        raise ValueError(f"block_m=192 tiles are 128 wide, got block_n={block_n}")
    if out is not None:
        check_tensor(out, "out", (torch.bfloat16,), dim=2, contiguous=False)
        if out.shape != (m, n):
            raise ValueError(f"out must be [M, N] = {[m, n]}, got {list(out.shape)}")
        if out.stride(1) != 1 or (m > 0 and (out.stride(0) % 8 != 0 or out.stride(0) < n)):
            raise ValueError(f"out needs unit column stride and a row pitch >= N that is a multiple of 8, got "
                             f"{out.stride()}")
    device = check_same_device(a=a, a_scales=a_scales, b=b, b_scales=b_scales,
                               groups=groups.tensor if type(groups) is Groups else groups, out=out)
    groups = check_groups(groups, g, m_total=m, name=groups_name(groups, g, "b"))
    # (with no rows nothing is read or written: the call returns before the kernel)
    if m > 0 and any_misaligned16(a, a_scales, b, out):
        for t, name in ((a, "a"), (a_scales, "a_scales"), (b, "b")):
            check_aligned16(t, name, "TMA loads it")
        check_aligned16(out, "out", "TMA stores its rows")
    return groups, device, m, n


def m_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    groups: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    block_n: int = 0,
    block_m: int = 0,
) -> torch.Tensor:
    """`out[rows of g] = (a[rows of g] * sa) . (b[g] * sb)^T` in BF16, for every group g.

    a: e4m3 `[M, K]`; a_scales: the `[M, K/128]` view from `quantize_1x128`; b: e4m3 `[G, N, K]`;
    b_scales: FP32 `[G, ceil(N/128), K/128]`; groups: int32/int64 sizes `[G]` or offsets `[G+1]` on a's device,
    or a `Groups` from `check_groups`.
    out: optional BF16 `[M, N]` (unit column stride, row pitch a multiple of 8, 16-byte aligned start; may be a
    row slice of a larger buffer). Rows are written only inside groups; nothing outside `out` is touched.
    block_m, block_n: the output tile, for tuning and comparison only (every tile gives the same bits; only the
    speed differs). Default (0, 0): the tile of `m_grouped_tile(M, N, G)`, from a wave model on M, N, G alone
    (no sync): 128 x 128, 128 x 192, or 192 x 128 on three math warpgroups when groups average >= 2048 rows.
    block_m=192 (with block_n 0 or 128) or block_m=128 (with block_n 0: 128 wide) force a tile; block_n 192 or
    256 give wider two-warpgroup tiles.
    """
    _ext.check_backend(backend)
    groups, device, m, _ = _check_m_grouped_args(a, a_scales, b, b_scales, groups, out, block_n, block_m)
    if m:  # (an empty `a` returns before any op, on every backend)
        _ext.check_backend(backend, device)
    return run_m_grouped(a, a_scales, b, b_scales, groups, out, backend, block_n, block_m)


def run_m_grouped(a, a_scales, b, b_scales, groups: Groups, out=None, backend="auto", block_n=0, block_m=0):
    """`m_grouped_fp8_gemm` on arguments that are valid by construction (the package's own quantizer outputs and
    checked `Groups`, as the autograd Functions hold them after their entry checks): no argument rules run here.
    The op's precondition checks still guard the kernel."""
    m, n, device = a.shape[0], b.shape[1], a.device
    if m == 0:  # no rows: nothing to compute (and TMA cannot describe an empty tensor)
        return out if out is not None else torch.empty((0, n), dtype=torch.bfloat16, device=device)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    ops.kernel("m_grouped_fp8_gemm_out", backend == "reference")(a, a_scales, b, b_scales, groups.tensor, out, block_n,
                                                                 block_m)
    return out


def m_grouped_tile(m_total: int, n: int, num_groups: int, block_n: int = 0, block_m: int = 0, device=None):
    """(block_m, block_n) of the output tile `m_grouped_fp8_gemm` launches for these sizes on `device` (default:
    the current CUDA device): the forced tile, or for (0, 0) the default that
    csrc/include/megatron_tma/scheduler/m_grouped_tile_choice.h picks. Needs the CUDA extension."""
    if not _ext.has_extension():
        raise RuntimeError("m_grouped_tile needs the CUDA extension (python setup.py build_ext --inplace)")
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        bm, bn = _ext.ops().m_grouped_fp8_gemm_tile(m_total, n, num_groups, block_n, block_m)
    return int(bm), int(bn)


def _check_k_grouped_args(dy_t, dy_t_scales, x_t, x_t_scales, groups, out, num_groups, accumulate, out_dtype,
                          m_total=None):
    """The wgrad rules of docs/design.md §4 (metadata only, plus the groups' values where they are on the host or debug
    checks are on); returns (Groups, device, N, K)."""
    for t, name in ((dy_t, "dy_t"), (x_t, "x_t")):
        check_tensor(t, name, (FP8,), dim=2, contiguous=False)
        if t.shape[1] > 0 and (t.stride(1) != 1 or t.stride(0) % 16 != 0 or t.stride(0) < t.shape[1]):
            raise ValueError(
                f"{name} must be the token-contiguous [rows, P] operand of quantize_grouped_128x1 (unit column "
                f"stride, row pitch a multiple of 16 and >= P), got strides {t.stride()} for shape {list(t.shape)}"
            )
    n, p = dy_t.shape
    k, p2 = x_t.shape
    if p2 != p:
        raise ValueError(f"dy_t and x_t must have the same token columns P, got dy_t {list(dy_t.shape)} and "
                         f"x_t {list(x_t.shape)}")
    if p > 0 and dy_t.stride(0) != x_t.stride(0):
        raise ValueError(f"dy_t and x_t must have the same row pitch, got {dy_t.stride(0)} and {x_t.stride(0)}")
    if p % 16 != 0:
        raise ValueError(f"P (the token columns of dy_t and x_t) must be a multiple of 16 (quantize_grouped_128x1 "
                         f"gives round_up(M_total, 128) + 128 G), got P={p}")
    if n == 0 or n % 16 != 0 or k == 0 or k % 16 != 0:
        raise ValueError(f"N and K must be positive multiples of 16, got N={n}, K={k}")
    check_tensor(dy_t_scales, "dy_t_scales", (torch.float32,), dim=2)
    check_tensor(x_t_scales, "x_t_scales", (torch.float32,), dim=2)
    mb = dy_t_scales.shape[0]
    if tuple(dy_t_scales.shape) != (mb, n) or tuple(x_t_scales.shape) != (mb, k):
        raise ValueError(
            f"token-block scales must be [MB, N] and [MB, K] with one MB (= M_total // 128 + G); got "
            f"{list(dy_t_scales.shape)} and {list(x_t_scales.shape)} for N={n}, K={k}"
        )
    if out_dtype is not torch.float32 and out_dtype is not torch.bfloat16:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if not isinstance(accumulate, bool):  # ("no" would be truthy: accumulate into out)
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__} {accumulate!r}")
    name = "groups"
    if out is not None:  # G comes from out, then num_groups, then the groups' length (sizes)
        check_tensor(out, "out", (torch.float32, torch.bfloat16), dim=3)
        if num_groups is not None and num_groups != out.shape[0]:
            raise ValueError(f"out holds G={out.shape[0]} groups but num_groups={num_groups}")
        num_groups = out.shape[0]
        name = groups_name(groups, num_groups, "out")
        if accumulate and out.dtype is not torch.float32:
            raise TypeError("accumulate=True needs an FP32 out (D = C + A.B in FP32)")
    elif accumulate:
        raise ValueError("accumulate=True needs the FP32 buffer to accumulate into as `out`")
    device = check_same_device(dy_t=dy_t, dy_t_scales=dy_t_scales, x_t=x_t, x_t_scales=x_t_scales,
                               groups=groups.tensor if type(groups) is Groups else groups, out=out)
    # M_total: the caller's m_total (then the sizes must sum to it, as m_grouped_fp8_gemm's to its rows), else what
    # P and MB tell of it (the host check below: the sizes must be those the operands were quantized with).
    groups = check_groups(groups, num_groups, m_total=m_total, name=name)
    g = groups.num_groups
    if m_total is not None and (p, mb) != (wgrad_pitch(m_total, g), max_tiles(m_total, g, 128)):
        raise ValueError(f"dy_t and x_t must be quantize_grouped_128x1's operands of m_total={m_total} tokens in {g} "
                         f"groups (P={wgrad_pitch(m_total, g)}, MB={max_tiles(m_total, g, 128)}), got P={p}, MB={mb}")
    if out is not None and out.shape[1:] != (n, k):
        raise ValueError(f"out must be [G, N, K] = {[g, n, k]}, got {list(out.shape)}")
    if g > K_GROUPED_MAX_GROUPS:
        check_num_groups(g, "K_GROUPED_MAX_GROUPS", "k_grouped_fp8_gemm")
    if mb < g:
        raise ValueError(f"token-block scales must have M_total // 128 + G >= G rows, got MB={mb} for G={g}"
                         + ("" if num_groups is not None else
                            " (G = the length of groups, read as sizes: offsets [G+1] need num_groups=G or out)"))
    if p < 128 * mb:
        raise ValueError(
            f"inconsistent wgrad operands: P >= 128 MB must hold (every quantize_grouped_128x1 output has "
            f"P = round_up(M_total, 128) + 128 G and MB = M_total // 128 + G), got P={p}, G={g}, MB={mb}"
        )
    if any_misaligned16(dy_t, x_t):
        check_aligned16(dy_t, "dy_t", "TMA loads it")
        check_aligned16(x_t, "x_t", "TMA loads it")
    if groups.tensor.device.type == "cpu" or debug_checks_enabled():  # free on the CPU; a sync otherwise
        host = groups.tensor.detach().cpu()  # one read for both rules
        check_wgrad_columns(host, groups.is_offsets, p, mb, name=name)
        check_wgrad_tokens(host, groups.is_offsets, p, mb, name=name)
    return groups, device, n, k


def k_grouped_fp8_gemm(
    dy_t: torch.Tensor,
    dy_t_scales: torch.Tensor,
    x_t: torch.Tensor,
    x_t_scales: torch.Tensor,
    groups: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    *,
    num_groups: Optional[int] = None,
    m_total: Optional[int] = None,
    block_m: int = 0,
) -> torch.Tensor:
    """Weight gradient `out[g] = dY_g^T . X_g` over each group's own tokens (any count, 0 included).

    dy_t / x_t: the token-contiguous `[N, P]` / `[K, P]` operands of `quantize_grouped_128x1` (group g's tokens at
    columns `[a_g, a_g + M_g)`, `a_g = sum_{h<g} round_up(M_h, 128)`, zeros between groups; the same P and row pitch,
    both multiples of 16), with their `[MB, N]` / `[MB, K]` token-block scales (`MB = M // 128 + G`; `P >= 128 MB` is
    checked).
    G is `out.shape[0]` when `out` is given, else `num_groups`, else `groups` holds sizes and G is its length
    (offsets `[G+1]` need `num_groups` or `out`).
    The sizes must cover every token of the operands, as `m_grouped_fp8_gemm`'s cover every row of `a` (never a
    partial dW): `m_total` (optional, the tokens the operands were quantized from) makes that exact (the sizes must sum
    to it); without it the sizes' sum must give the operands' P and MB, which fix M_total up to their rounding. The
    sum is read on the host only where the groups are (CPU) or with debug checks on, as for `m_grouped_fp8_gemm`.
    accumulate=True adds into `out` (FP32, e.g. Megatron's main_grad): `out = out + dY^T . X`, and an empty
    group leaves its slice unchanged. Otherwise returns a new (or the given) `[G, N, K]` tensor of out_dtype
    (a given `out` keeps its own dtype, FP32 or BF16). `out` must be contiguous; a 16-byte aligned `out` is written
    through TMA stores (and read by TMA when accumulating), any other one (e.g. a main_grad view at an odd float
    offset) element by element from registers: the same values.
    block_m: the output tile's rows, for tuning and comparison only (both tiles give the same bits): 0 the default
    (`k_grouped_tile(N, K, G, out_dtype)`: a wave model on N, K, G alone, no sync), 128, or 192 (three math
    warpgroups; 128 where the groups do not fit its shared memory).
    """
    _ext.check_backend(backend)
    if block_m not in (0, 128, 192):
        raise ValueError(f"block_m must be 0 (auto), 128 or 192, got {block_m!r}")
    groups, device, _, _ = _check_k_grouped_args(dy_t, dy_t_scales, x_t, x_t_scales, groups, out, num_groups,
                                                 accumulate, out_dtype, m_total)
    _ext.check_backend(backend, device)
    return run_k_grouped(dy_t, dy_t_scales, x_t, x_t_scales, groups, out, accumulate, out_dtype, backend, block_m)


def run_k_grouped(dy_t, dy_t_scales, x_t, x_t_scales, groups: Groups, out=None, accumulate=False,
                  out_dtype=torch.float32, backend="auto", block_m=0):
    """`k_grouped_fp8_gemm` on arguments that are valid by construction (as `run_m_grouped`): no argument rules
    run here; the op's precondition checks still guard the kernel."""
    device = dy_t.device
    if out is None:
        out = torch.empty((groups.num_groups, dy_t.shape[0], x_t.shape[0]), dtype=out_dtype, device=device)
    ops.kernel("k_grouped_fp8_gemm_out", backend == "reference")(dy_t, dy_t_scales, x_t, x_t_scales, groups.tensor, out,
                                                                 accumulate, block_m)
    return out


def k_grouped_tile(n: int, k: int, num_groups: int, out_dtype=torch.float32, block_m: int = 0, device=None):
    """(block_m, block_n) of the output tile `k_grouped_fp8_gemm` launches for an [G, N, K] output of `out_dtype`
    on `device` (default: the current CUDA device): the forced rows, or for 0 the default that
    csrc/include/megatron_tma/scheduler/k_grouped_tile_choice.h picks. Needs the CUDA extension."""
    if not _ext.has_extension():
        raise RuntimeError("k_grouped_tile needs the CUDA extension (python setup.py build_ext --inplace)")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        bm, bn = _ext.ops().k_grouped_fp8_gemm_tile(n, k, num_groups, out_dtype == torch.bfloat16, block_m)
    return int(bm), int(bn)
