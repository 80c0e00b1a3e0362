"""The numerics contract (docs/design.md §3) and the byte layouts (docs/layouts.md) in plain torch.

This is the oracle: every quantizer kernel must match it bit for bit, and the GEMM kernels must match
its padded==unpadded property bit for bit and its float64 twins within ``diff < 1e-3``. It runs on any
device (CPU for the unit tests, CUDA to check kernels) and favours clarity over speed: it may read the
group sizes on the host and loops over groups and blocks.

Block scale (``block_scale``, the only place the formula is written). For a block with amax ``a``
(FP32 max of |x| over the block) it returns the dequantization scale ``s`` and the quantization
multiplier ``m``; every quantizer then computes ``q = e4m3_satfinite_rn(x * m)``, one FP32 multiply:

* ``a == 0``: ``s = 1``, ``m = 0`` (data +-0, the sign of an input zero is kept: -0 -> 0x80).
* ``0 < a < 2^-119``: ``a`` is raised to ``AMAX_FLOOR = 2^-119`` first. Below ``448 / FLT_MAX``
  (~1.3e-36) the literal ``448 / a`` overflows to Inf and the block's zeros would turn into
  ``0 * Inf = NaN``; ``2^-119`` is the first power of two where it stays finite. This changes nothing
  for any ``a >= 2^-119`` and keeps ``s`` representable (denormal for ``a < 448 * 2^-126``, never flushed).
* FP32 mode: ``s = a / 448`` and ``m = 448 / a``, each one correctly rounded FP32 division.
* pow2 mode: ``s = 2^ceil(log2(a / 448))``, the smallest power of two >= the FP32 quotient, taken
  exactly from its bits (``pow2_ceil``), and ``m = 1 / s``, which is exact, so ``x * m == x / s`` bit
  for bit. ``s`` lies in [2^-127, 2^120] (UE8M0-representable).
* satfinite: the product is clamped to [-448, 448] and rounded to nearest even; NaN stays NaN and is
  written as 0x7F whatever its sign (as ``cvt.rn.satfinite.e4m3x2.f32`` does). Denormals are kept.

NaN/Inf policy (pinned by tests/test_reference.py). ``a`` propagates NaN and orders NaN > Inf >
finite, which is what the kernels' unsigned-integer max over the bits of |x| gives:

* ``a = +Inf`` (an Inf and no NaN in the block): ``s = Inf``, ``m = 0``: finite x -> +-0, +-Inf -> NaN.
* ``a = NaN`` (any NaN in the block, with or without Inf): ``s = NaN``, every q of the block is NaN.
* Other blocks are unaffected. In the GEMMs NaN and Inf then follow IEEE FP32 arithmetic.

GEMM accumulation (docs/design.md §3): for each output element and each 128-wide K block in ascending order,
``p`` = the block's dot product of the FP8 values rounded once to FP32, then
``acc = fma(sa * sb, p, acc)`` with ``sa * sb`` an FP32 product and ``acc`` starting at 0. The block
dot product is computed exactly in float64: FP8 e4m3 values are multiples of 2^-9 below 2^9, so the
products are multiples of 2^-18 below 2^18 and any partial sum of 128 of them needs < 43 bits. Hence
the result does not depend on summation order or on which other rows are in the matmul, and every row
is computed independently (padding a group never changes another row). The tensor cores do not round
like this (their FP8 accumulator is narrower), so kernels are compared to this oracle by the docs/design.md
``diff`` and by their own padded==unpadded bit equality, not bit for bit.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import groups as _groups
from ._validate import FP8, check_tensor

FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 2.0 ** -119
E4M3_NAN_BYTE = 0x7F

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------------
# The scale formula
# --------------------------------------------------------------------------------------------------
def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v for FP32 v > 0, computed exactly from the bits; Inf/NaN pass through.

    Normal v: keep the exponent and add one if the mantissa is non-zero (an exponent overflow lands on
    the Inf encoding, correctly). Denormal v = mant * 2^-149: the answer is the next power of two of
    the integer mantissa, whose bit pattern is already the FP32 encoding (2^23 becomes 2^-126).
    """
    if v.dtype != torch.float32:
        raise TypeError(f"pow2_ceil expects float32, got {v.dtype}")
    bits = v.view(torch.int32) & 0x7FFFFFFF
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    normal = (exp + (mant != 0).to(torch.int32)) << 23
    n = mant - 1
    for shift in (1, 2, 4, 8, 16):
        n = n | (n >> shift)
    denormal = n + 1
    out = torch.where(exp == 0, denormal, normal).view(torch.float32)
    return torch.where(torch.isfinite(v), out, v)


def block_scale(amax: torch.Tensor, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(s, m) for blocks with max |x| = amax (FP32): dequantize with ``x ~ q * s``, quantize with ``x * m``.

    See the module docstring for the rules. Divisions are tensor/tensor on purpose: ``448.0 / t`` in
    torch is ``t.reciprocal() * 448`` (two roundings), and CUDA turns ``t / 448.0`` into a multiply by
    the reciprocal; neither is the contract's single FP32 division.
    """
    amax = amax.to(torch.float32)
    c448 = torch.full_like(amax, FP8_MAX)
    a = torch.where(amax < AMAX_FLOOR, torch.full_like(amax, AMAX_FLOOR), amax)  # NaN compares False: kept
    if pow2:
        s = pow2_ceil(a / c448)
        m = torch.ones_like(s) / s
    else:
        s = a / c448
        m = c448 / a
    zero = amax == 0
    return torch.where(zero, torch.ones_like(s), s), torch.where(zero, torch.zeros_like(m), m)


def fp8_e4m3_satfinite(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> e4m3fn with round-to-nearest-even, +-448 saturation, NaN -> 0x7F (cvt.rn.satfinite).

    The explicit clamp keeps saturation independent of the torch version's own cast overflow rule.
    """
    q = v.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    q = torch.where(torch.isnan(v), torch.full_like(q, E4M3_NAN_BYTE), q)
    return q.view(FP8)


def _quantize_blocks(xb: torch.Tensor, reduce_dims, pow2: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """xb: FP32 data reshaped so that each block spans ``reduce_dims``; returns (q like xb, s keepdim)."""
    amax = xb.abs().amax(dim=reduce_dims, keepdim=True)  # propagates NaN, and NaN wins over Inf
    s, m = block_scale(amax, pow2)
    return fp8_e4m3_satfinite(xb * m), s


# --------------------------------------------------------------------------------------------------
# Layout helpers (docs/layouts.md)
# --------------------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def alloc_1x128_scales(m: int, k_blocks: int, device=None) -> torch.Tensor:
    """The 1x128 scale layout: a [m, k_blocks] view (strides (1, m_pad)) of FP32 storage
    [k_blocks, m_pad], m_pad = ceil(m/4)*4, M contiguous so that TMA gets a 16-byte aligned stride.
    Filled with 1.0, which is what the pad entries (rows m..m_pad) must hold."""
    storage = torch.ones(k_blocks, _cdiv(m, 4) * 4, dtype=torch.float32, device=device)
    return storage[:, :m].t()


def _zeros_fp8(shape, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8, device=device).view(FP8)


def _padded_row_index(sizes: List[int], align: int, device) -> torch.Tensor:
    """Destination row of every source row when each group is padded to a multiple of ``align``.

    With align = 128 it is also ``128 * (global token block) + position in block`` for the per-group
    128x1 layout, whose blocks start at each group's first row.
    """
    parts, dst = [], 0
    for m in sizes:
        parts.append(torch.arange(dst, dst + m, dtype=torch.int64))
        dst += _cdiv(m, align) * align
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return idx.to(device)


def _group_rows(sizes: List[int]):
    start = 0
    for g, m in enumerate(sizes):
        yield g, start, start + m
        start += m


# --------------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------------
def quantize_1x128(x: torch.Tensor, pow2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activations: one scale per row per 128 columns. x [M, K] -> (q [M, K] e4m3, s [M, ceil(K/128)]).

    ``s`` has the strided layout of ``alloc_1x128_scales``. The last column block may be partial;
    M = 0 gives empty tensors of the right layout.
    """
    check_tensor(x, "x", _FLOAT_INPUTS, dim=2, contiguous=False)
    M, K = x.shape
    kb = _cdiv(K, BLOCK)
    xb = F.pad(x.to(torch.float32), (0, kb * BLOCK - K)).view(M, kb, BLOCK)
    q, s = _quantize_blocks(xb, -1, pow2)
    scales = alloc_1x128_scales(M, kb, x.device)
    scales.copy_(s.view(M, kb))
    return q.view(M, kb * BLOCK)[:, :K].contiguous(), scales


def quantize_128x128(w: torch.Tensor, pow2: bool = False):
    """Weights: one scale per 128x128 block. w [G, N, K] (or [N, K]) -> (q, s, qt, st).

    q [G, N, K] e4m3; s [G, ceil(N/128), ceil(K/128)]; qt = q^T [G, K, N] and st = s^T, both
    materialised (the same bytes transposed: dgrad's operand without re-quantization). Edge blocks
    may be partial. A 2-D w gives 2-D/2-D outputs without the G dim.
    """
    check_tensor(w, "w", _FLOAT_INPUTS, contiguous=False)
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [N, K] or [G, N, K], got shape {tuple(w.shape)}")
    squeeze = w.dim() == 2
    w3 = w.unsqueeze(0) if squeeze else w
    G, N, K = w3.shape
    nb, kb = _cdiv(N, BLOCK), _cdiv(K, BLOCK)
    wp = F.pad(w3.to(torch.float32), (0, kb * BLOCK - K, 0, nb * BLOCK - N))
    q, s = _quantize_blocks(wp.view(G, nb, BLOCK, kb, BLOCK), (2, 4), pow2)
    q = q.view(G, nb * BLOCK, kb * BLOCK)[:, :N, :K].contiguous()
    s = s.view(G, nb, kb).contiguous()
    qt, st = transpose_128x128(q, s)
    if squeeze:
        q, s, qt, st = q[0], s[0], qt[0], st[0]
    return q, s, qt, st


def quantize_128x128_from_master(master: torch.Tensor, pow2: bool = False):
    """FP32 master weights [G, N, K] quantized as their BF16 rounding (the copy a mixed-precision optimizer writes into
    BF16 model weights): `quantize_128x128(master.bfloat16())`, what the CUDA kernel writes without that copy."""
    check_tensor(master, "master", (torch.float32,), dim=3, contiguous=False)
    return quantize_128x128(master.to(torch.bfloat16), pow2)


def transpose_128x128(q: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """W^T's copy from W's: (q [.., N, K], s [.., N/128, K/128]) -> (qt [.., K, N], st [.., K/128, N/128]), contiguous.
    With one scale per 128x128 block the quantized transpose is the transposed bytes and scales. Always copies (a
    transposed [.., 1, n] is already contiguous), so neither output is a view of an input."""
    def copy(t):
        return t.transpose(-1, -2).clone(memory_format=torch.contiguous_format)

    return copy(q.view(torch.uint8)).view(FP8), copy(s)


def quantize_grouped_128x1(
    x: torch.Tensor, groups: torch.Tensor, pow2: bool = False, num_groups: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Wgrad operands: one scale per column per 128-token block of each group. x [M, K] -> (qt, s).

    Blocks start at each group's first row (they never mix groups; a group's last block may be
    partial; empty groups own none). ``qt`` is e4m3 [K, P], contiguous, P = round_up(M, 128) + 128 G
    (``groups.wgrad_pitch``): group g's tokens sit at columns [a_g, a_g + M_g), a_g = sum_{h<g}
    round_up(M_h, 128), ``qt[k, a_g + t] = q(x[o_g + t, k])``; every other column is zero (the <= 127
    between groups and the tail [a_G, P)). ``s`` is FP32 [M//128 + G, K]: row B_g + j holds block j of
    group g, rows past the last used block are 0. M == 0 gives zeros [K, 128 G] and [G, K].
    ``groups``: sizes [G], or offsets [G+1] with ``num_groups`` = G (see groups.check_groups), or a ``Groups``.
    """
    check_tensor(x, "x", _FLOAT_INPUTS, dim=2, contiguous=False)
    M, K = x.shape
    sizes = _groups.host_group_sizes(groups, num_groups, M, device=x.device)
    G = len(sizes)
    used = sum(_cdiv(m, BLOCK) for m in sizes)
    dest = _padded_row_index(sizes, BLOCK, x.device)
    xp = torch.zeros(used * BLOCK, K, dtype=torch.float32, device=x.device)
    xp[dest] = x.to(torch.float32)  # zero padding rows leave each block's amax unchanged
    q, s = _quantize_blocks(xp.view(used, BLOCK, K), 1, pow2)
    q_rows = q.view(used * BLOCK, K).view(torch.uint8)[dest]
    qt = torch.zeros(K, _groups.wgrad_pitch(M, G), dtype=torch.uint8, device=x.device)
    qt[:, _aligned_columns(sizes, x.device)] = q_rows.t()
    scales = torch.zeros(_groups.max_tiles(M, G, BLOCK), K, dtype=torch.float32, device=x.device)
    scales[:used] = s.view(used, K)
    return qt.view(FP8), scales


def _aligned_columns(sizes: List[int], device) -> torch.Tensor:
    """The wgrad column of every token: a_g + t for token t of group g (groups start on 128-column boundaries)."""
    return _padded_row_index(sizes, _groups.WGRAD_ALIGN, device)


# --------------------------------------------------------------------------------------------------
# Dequantizers (exact in float64; float32 rounds each q * s once)
# --------------------------------------------------------------------------------------------------
def dequantize_1x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    M, K = q.shape
    return q.to(dtype) * s.to(dtype).repeat_interleave(BLOCK, dim=1)[:, :K]


def dequantize_128x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape[-2:]
    full = s.to(dtype).repeat_interleave(BLOCK, dim=-2)[..., :N, :].repeat_interleave(BLOCK, dim=-1)[..., :K]
    return q.to(dtype) * full


def dequantize_grouped_128x1(
    qt: torch.Tensor,
    s: torch.Tensor,
    groups: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    num_groups: Optional[int] = None,
) -> torch.Tensor:
    """Inverse of quantize_grouped_128x1, returned untransposed: [M, K] (M = the groups' total).

    Group g's tokens are read at columns [a_g, a_g + M_g) of qt [K, P]. ``groups``: sizes [G], or offsets
    [G+1] with ``num_groups`` = G (as the K-grouped GEMM: without num_groups the tensor holds sizes).
    """
    sizes = _wgrad_sizes(groups, num_groups, qt.shape[1], s.shape[0], qt.device)
    cols = _aligned_columns(sizes, qt.device)
    block = _padded_row_index(sizes, BLOCK, qt.device) // BLOCK
    return qt.view(torch.uint8)[:, cols].view(FP8).t().to(dtype) * s.to(dtype)[block]


def _wgrad_sizes(groups, num_groups: Optional[int], p: int, mb: int, device) -> List[int]:
    """Host group sizes of wgrad operands with P token columns and MB scale rows, checked to fit both."""
    g = _groups.check_groups(groups, num_groups, device=device)
    sizes = _groups.host_group_sizes(g, num_groups, device=device)
    _groups.check_wgrad_columns(g.tensor, g.is_offsets, p, mb)
    return sizes


# --------------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------------
def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """FP32 fma(a, b, c). a*b is exact in float64 (24+24 bits); the float64 sum is then rounded again
    to FP32. That equals the true single-rounding fma except in rare double-rounding cases (the
    float64 sum landing exactly on an FP32 tie), which the tests never depend on."""
    return (a.to(torch.float64) * b.to(torch.float64) + c.to(torch.float64)).to(torch.float32)


def m_grouped_fp8_gemm(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    groups: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Y[rows of g] = A_g . B_g^T with the docs/design.md §3 accumulation; returns [M, N] in out_dtype.

    a [M, K] e4m3 with 1x128 scales a_s [M, ceil(K/128)] (any strides); b [G, N, K] e4m3 with
    128x128 scales b_s [G, ceil(N/128), ceil(K/128)]. Forward passes W and its scales; dgrad passes
    W^T [G, K_in, N_out] and st, the same call. G comes from b; groups are sizes [G] or offsets [G+1].
    """
    check_tensor(a, "a", (FP8,), dim=2, contiguous=False)
    check_tensor(b, "b", (FP8,), dim=3, contiguous=False)
    M, K = a.shape
    G, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [G, N, K] = {tuple(b.shape)}: K differs")
    kb = _cdiv(K, BLOCK)
    check_tensor(a_s, "a_s", (torch.float32,), dim=2, contiguous=False)
    check_tensor(b_s, "b_s", (torch.float32,), dim=3, contiguous=False)
    if tuple(a_s.shape) != (M, kb):
        raise ValueError(f"a_s must be [M, ceil(K/128)] = {(M, kb)}, got {tuple(a_s.shape)}")
    if tuple(b_s.shape) != (G, _cdiv(N, BLOCK), kb):
        raise ValueError(f"b_s must be [G, ceil(N/128), ceil(K/128)] = {(G, _cdiv(N, BLOCK), kb)}, "
                         f"got {tuple(b_s.shape)}")
    sizes = _groups.host_group_sizes(groups, G, M, device=a.device)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    for g, r0, r1 in _group_rows(sizes):
        if r0 == r1:
            continue
        a64 = a[r0:r1].to(torch.float64)
        b64 = b[g].to(torch.float64)
        sb = b_s[g].repeat_interleave(BLOCK, dim=0)[:N]  # [N, kb]: the scale of every column
        acc = torch.zeros(r1 - r0, N, dtype=torch.float32, device=a.device)
        for k in range(kb):
            ks = slice(k * BLOCK, min(K, (k + 1) * BLOCK))
            p = (a64[:, ks] @ b64[:, ks].t()).to(torch.float32)  # exact, then one rounding
            sasb = a_s[r0:r1, k].unsqueeze(1) * sb[:, k].unsqueeze(0)  # FP32 product
            acc = _fma32(sasb, p, acc)
        out[r0:r1] = acc.to(out_dtype)  # BF16: round to nearest even
    return out


def k_grouped_fp8_gemm(
    dy_t: torch.Tensor,
    dy_s: torch.Tensor,
    x_t: torch.Tensor,
    x_s: torch.Tensor,
    groups: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    *,
    num_groups: Optional[int] = None,
) -> torch.Tensor:
    """dW_g = dY_g^T . X_g, tokens contracted, with the docs/design.md §3 accumulation; returns [G, N, K].

    dy_t [N, P] and x_t [K, P] e4m3 (token-contiguous, any row pitch) in the 128-aligned layout of
    quantize_grouped_128x1: group g contracts over columns [a_g, a_g + M_g), a_g = sum_{h<g}
    round_up(M_h, 128), with the per-group token-block scales dy_s [MB, N] and x_s [MB, K]. G is
    ``out.shape[0]`` when out is given, else ``num_groups``, else ``groups`` holds sizes and G is its
    length (offsets [G+1] need num_groups or out). For each group, ``acc`` runs over the group's token
    blocks [a_g + 128 j, min(a_g + 128 (j+1), a_g + M_g)) in ascending order with ``sa = dy_s[B_g + j, n]``,
    ``sb = x_s[B_g + j, k]``. Output: ``acc`` (empty group: 0), or with ``out=C, accumulate=True``
    ``C + acc`` as one FP32 add after the whole accumulation, round to nearest, subnormals kept (the TMA
    reduce-add's add, measured; empty group: C left untouched). The result
    is written into ``out`` when given; otherwise a new tensor of out_dtype (default float32) is returned.
    """
    check_tensor(dy_t, "dy_t", (FP8,), dim=2, contiguous=False)
    check_tensor(x_t, "x_t", (FP8,), dim=2, contiguous=False)
    N, P = dy_t.shape
    K, Px = x_t.shape
    if Px != P:
        raise ValueError(f"dy_t is [N, P] = {tuple(dy_t.shape)} but x_t is [K, P] = {tuple(x_t.shape)}: P differs")
    check_tensor(dy_s, "dy_s", (torch.float32,), dim=2)
    check_tensor(x_s, "x_s", (torch.float32,), dim=2)
    MB = dy_s.shape[0]
    if tuple(dy_s.shape) != (MB, N) or tuple(x_s.shape) != (MB, K):
        raise ValueError(f"dy_s and x_s must be [MB, N] and [MB, K] with one MB (= M//128 + G), got "
                         f"{tuple(dy_s.shape)} and {tuple(x_s.shape)} for N={N}, K={K}")
    if out is not None:
        check_tensor(out, "out", (torch.float32, torch.bfloat16), contiguous=False)
        if out.dim() != 3:
            raise ValueError(f"out must be [G, N, K], got shape {tuple(out.shape)}")
        if num_groups is not None and num_groups != out.shape[0]:
            raise ValueError(f"out holds {out.shape[0]} groups but num_groups={num_groups}")
        num_groups = out.shape[0]
    sizes = _wgrad_sizes(groups, num_groups, P, MB, dy_t.device)
    G = len(sizes)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out= (the buffer C of D = C + A.B)")
        out = torch.empty(G, N, K, dtype=out_dtype or torch.float32, device=dy_t.device)
    else:
        if tuple(out.shape) != (G, N, K):
            raise ValueError(f"out must be [G, N, K] = {(G, N, K)}, got {tuple(out.shape)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype}")
    block, col = 0, 0
    for g, m in enumerate(sizes):
        a_g, col = col, col + _cdiv(m, _groups.WGRAD_ALIGN) * _groups.WGRAD_ALIGN
        if m == 0:
            if not accumulate:
                out[g] = 0
            continue
        acc = torch.zeros(N, K, dtype=torch.float32, device=dy_t.device)
        for t0 in range(0, m, BLOCK):
            ts = slice(a_g + t0, a_g + min(m, t0 + BLOCK))
            p = (dy_t[:, ts].to(torch.float64) @ x_t[:, ts].to(torch.float64).t()).to(torch.float32)
            sasb = dy_s[block].unsqueeze(1) * x_s[block].unsqueeze(0)  # FP32 product
            acc = _fma32(sasb, p, acc)
            block += 1
        if accumulate:
            acc = out[g].to(torch.float32) + acc
        out[g] = acc.to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# The padded twin's un-padding (host-side; megatron_tma.testing.pad_groups_rows pads)
# --------------------------------------------------------------------------------------------------
def unpad_rows(y_pad: torch.Tensor, groups: torch.Tensor, align: int, num_groups: Optional[int] = None):
    """The valid rows of a padded-layout result, in the unpadded order (``groups`` are the unpadded ones)."""
    sizes = _groups.host_group_sizes(groups, num_groups)
    total = sum(_cdiv(m, align) * align for m in sizes)
    if y_pad.shape[0] != total:
        raise ValueError(f"y_pad has {y_pad.shape[0]} rows, but the groups padded to {align} have {total}")
    return y_pad[_padded_row_index(sizes, align, y_pad.device)]


# --------------------------------------------------------------------------------------------------
# The expert activation times the routing probs (megatron_tma.activation): FP32 math from h, one rounding
# --------------------------------------------------------------------------------------------------
ACTIVATIONS = ("swiglu", "gelu", "squared_relu", "geglu")  # index = the kernels' activation id (host/activation.h)
GATED = ("swiglu", "geglu")  # h = [gate | up]: `[T, 2F]`, act(gate) * up


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        f = h.shape[1] // 2
        return F.silu(h[:, :f]) * h[:, f:]
    if activation == "geglu":
        f = h.shape[1] // 2
        return F.gelu(h[:, :f]) * h[:, f:]
    if activation == "gelu":
        return F.gelu(h)  # the exact (erf) GELU, Megatron's F.gelu
    return torch.relu(h).square()


def _activation_backward(da: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(h) / dh applied to da, for FP32 h."""
    if activation == "swiglu":
        f = h.shape[1] // 2
        gate, up = h[:, :f], h[:, f:]
        return torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * F.silu(gate)], dim=1)
    if activation == "geglu":
        f = h.shape[1] // 2
        gate, up = h[:, :f], h[:, f:]
        return torch.cat([torch.ops.aten.gelu_backward(da * up, gate), da * F.gelu(gate)], dim=1)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, h)
    return da * (2.0 * torch.relu(h))


def _row_sum(v: torch.Tensor) -> torch.Tensor:
    """Row sums of an FP32 `[T, F]` tensor by pairwise halving, so that each row's rounding is fixed by F alone.

    torch's reductions split a row's sum differently depending on how many rows there are (threads on the CPU,
    CTAs per output on the GPU), which would make the padded twin's probs gradient differ in the last bit.
    Elementwise adds of column halves do not (about log2(F) small launches; twice the traffic of one pass).
    """
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        s = v[:, :half] + v[:, half : 2 * half]
        if v.shape[1] % 2:
            s[:, :1] += v[:, -1:]
        v = s
    return v[:, 0]


def act_times_probs_forward(h: torch.Tensor, probs: Optional[torch.Tensor], activation: str) -> torch.Tensor:
    """z = act(h) * probs[:, None] in FP32 from h, one rounding to h's dtype."""
    a = _activation(h.float(), activation)
    if probs is not None:
        a.mul_(probs.float().unsqueeze(1))
    return a.to(h.dtype)


def act_times_probs_backward(dz: torch.Tensor, h: torch.Tensor, probs: Optional[torch.Tensor], activation: str,
                             need_dh: bool = True, need_dprobs: bool = True):
    """(dh or None, dprobs in probs' dtype or None) of z = act(h) * probs[:, None] for the upstream gradient dz."""
    need_dprobs = need_dprobs and probs is not None
    h32, dz32 = h.float(), dz.float()
    dh = dprobs = None
    if need_dprobs:
        dprobs = _row_sum(dz32 * _activation(h32, activation)).to(probs.dtype)
    if need_dh:
        da = dz32 * probs.float().unsqueeze(1) if probs is not None else dz32
        dh = _activation_backward(da, h32, activation).to(h.dtype)
    return dh, dprobs


# --------------------------------------------------------------------------------------------------
# The MoE permutation's combine (megatron_tma.permutation)
# --------------------------------------------------------------------------------------------------
def combine_rows(y: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    """Each token's k rows of y added in FP32 in ascending order from +0, rounded once (megatron_tma.permutation)."""
    acc = torch.zeros(token_rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    index = token_rows.long()
    for j in range(token_rows.shape[1]):  # the kernel's order: j = 0..k-1, each add rounded in FP32
        acc += y.index_select(0, index[:, j]).float()
    return acc.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# The padded baseline's row gathers (megatron_tma.padding); they read the group sizes on the host
# --------------------------------------------------------------------------------------------------
def _exclusive_cumsum(values: List[int]) -> List[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _row_map(sizes: List[int], src_offsets: List[int], dst_offsets: List[int], device) -> torch.Tensor:
    """int64 [sum(sizes)]: for row r of group g, src_offsets[g] + r -> dst_offsets[g] + r, indexed by source."""
    num = torch.tensor(sizes, dtype=torch.int64)
    shift = torch.tensor(dst_offsets[:-1], dtype=torch.int64) - torch.tensor(src_offsets[:-1], dtype=torch.int64)
    rows = torch.arange(sum(sizes), dtype=torch.int64)
    return (rows + torch.repeat_interleave(shift, num)).to(device)


def pad_rows_fp8(a, a_scales, groups, num_groups: int, align: int):
    """megatron_tma.padding.pad_rows_fp8 (the op's arguments): every group padded to a multiple of align rows."""
    m, k = a.shape
    sizes = _groups.host_group_sizes(groups, num_groups, m, device=a.device)
    offsets = _exclusive_cumsum(sizes)
    padded_offsets = _exclusive_cumsum([(s + align - 1) // align * align for s in sizes])
    m_pad = _groups.padded_row_count_upper_bound(m, num_groups, align)
    dest = _row_map(sizes, offsets, padded_offsets, a.device)

    a_pad = torch.zeros((m_pad, k), dtype=torch.uint8, device=a.device)
    a_pad[dest] = a.view(torch.uint8)  # bytes: no FP8 arithmetic
    a_scales_pad = alloc_1x128_scales(m_pad, (k + 127) // 128, a.device)  # all 1.0; pitch m_pad (a multiple of 16)
    a_scales_pad[dest] = a_scales
    return a_pad.view(FP8), a_scales_pad, torch.tensor(padded_offsets, dtype=torch.int32, device=a.device)


def unpad_rows_bf16(y_pad, groups, padded_offsets, out):
    """megatron_tma.padding.unpad_rows into out (the op's arguments): the valid rows of y_pad."""
    m_total = out.shape[0]
    num_groups = padded_offsets.numel() - 1
    sizes = _groups.host_group_sizes(groups, num_groups, m_total, device=y_pad.device)
    padded_sizes = _groups.host_group_sizes(padded_offsets, num_groups, device=y_pad.device, name="padded_offsets")
    short = [g for g in range(num_groups) if padded_sizes[g] < sizes[g]]
    if short:
        g = short[0]
        raise ValueError(
            f"padded_offsets give group {g} {padded_sizes[g]} rows but it has {sizes[g]}: "
            "not a padding of these groups"
        )
    if sum(padded_sizes) > y_pad.shape[0]:
        raise ValueError(f"padded_offsets end at row {sum(padded_sizes)}, but y_pad has {y_pad.shape[0]} rows")
    src = _row_map(sizes, _exclusive_cumsum(sizes), _exclusive_cumsum(padded_sizes), y_pad.device)
    out.view(torch.int16).copy_(y_pad.view(torch.int16)[src])  # bytes: NaN payloads kept
    return out
