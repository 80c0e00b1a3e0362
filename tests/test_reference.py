"""megatron_tma.reference: the scale formula, the byte layouts, the NaN/Inf policy and the GEMM oracle.

The formula checks compare against independent scalar implementations (numpy FP32 arithmetic,
exact rationals, a table-driven e4m3 rounding) rather than against torch's own casts.
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from _dists import EDGE_GROUPINGS, group_tensor, make_group_sizes, random_rows

from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma._validate import FP8
from megatron_tma.groups import aligned_token_offsets, token_block_offsets

INF, NAN = float("inf"), float("nan")
E4M3_NAN = 0x7F
ONE_448 = float(np.float32(1) / np.float32(448))  # fl32(1/448): the scale of a block with amax 1


# ------------------------------------------------------------------------------------------------
# Independent scalar models
# ------------------------------------------------------------------------------------------------
def _e4m3_decode(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return NAN
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


_POS = np.array([_e4m3_decode(c) for c in range(0x7F)])  # codes 0x00..0x7E, increasing


def e4m3_bytes(v) -> np.ndarray:
    """Round-to-nearest-even onto the e4m3 grid with +-448 saturation, NaN -> 0x7F (table driven)."""
    v = np.asarray(v, dtype=np.float64).ravel()
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 0, 126)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = code | (np.signbit(v).astype(np.int64) << 7)
    return np.where(np.isnan(v), 0x7F, code).astype(np.uint8)


def np_block_scale(amax: np.ndarray, pow2: bool):
    """The documented formula with numpy FP32 scalar arithmetic (IEEE, correctly rounded)."""
    amax = np.asarray(amax, dtype=np.float32)
    a = np.where(amax < np.float32(2.0 ** -119), np.float32(2.0 ** -119), amax)
    with np.errstate(all="ignore"):
        if pow2:
            q = (a / np.float32(448)).ravel()
            s = np.array([exact_pow2_ceil(float(v)) for v in q], dtype=np.float32).reshape(a.shape)
            m = np.float32(1) / s
        else:
            s, m = a / np.float32(448), np.float32(448) / a
    return np.where(amax == 0, np.float32(1), s), np.where(amax == 0, np.float32(0), m)


def exact_pow2_ceil(v: float) -> float:
    if not math.isfinite(v):
        return v
    mant, exp = math.frexp(v)  # v = mant * 2^exp, 0.5 <= mant < 1, exact
    return 2.0 ** (exp - 1) if mant == 0.5 else 2.0 ** exp


def round_to_bits(x: Fraction, mant_bits: int, min_exp: int) -> float:
    """Correctly rounded (nearest even) binary float with ``mant_bits`` fraction bits and the
    smallest normal exponent ``min_exp``: FP32 is (23, -126), BF16 (7, -126)."""
    if x == 0:
        return 0.0
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, min_exp) - mant_bits)
    n = a / quantum
    r = math.floor(n)
    if n - r > Fraction(1, 2) or (n - r == Fraction(1, 2) and r % 2 == 1):
        r += 1
    return sign * float(r * quantum)


def f32(x: Fraction) -> float:
    return round_to_bits(x, 23, -126)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def qbytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# The formula: rounding, scales, pow2, satfinite
# ------------------------------------------------------------------------------------------------
def test_e4m3_rounding_matches_table(gen):
    grid = torch.tensor([_e4m3_decode(c) for c in range(0x7F)], dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: must go to the even code
    values = torch.cat([
        grid, -grid, mids, -mids,
        torch.nextafter(mids.float(), torch.tensor(INF)).double(),  # just past each tie
        torch.nextafter(mids.float(), torch.tensor(0.0)).double(),  # just short of it
        torch.exp2(torch.empty(4000).uniform_(-14, 10, generator=gen)).double()
        * torch.randn(4000, generator=gen).sign(),
        torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e6, -1e6, INF, -INF, NAN, -NAN, 0.0, -0.0,
                      2.0 ** -10, -(2.0 ** -10), 1e-40, -1e-40, 2.0 ** -149]),
    ]).float()
    got = as_np(qbytes(R.fp8_e4m3_satfinite(values)))
    np.testing.assert_array_equal(got, e4m3_bytes(as_np(values)))
    assert got[as_np(values) == 2.0 ** -10][0] == 0x00  # half the smallest subnormal ties to 0
    assert set(got[np.isnan(as_np(values))]) == {0x7F}  # NaN canonical whatever the sign


def _amax_samples(gen, n=3000) -> torch.Tensor:
    exps = torch.empty(n).uniform_(-149, 127.9, generator=gen)
    samples = torch.exp2(exps.double()).float()
    special = torch.tensor([0.0, 448.0, 1.0, 2.0 ** -149, 2.0 ** -130, 2.0 ** -119, 2.0 ** -118,
                            448 * 2.0 ** -126, 3.4e38, 448 * 2.0 ** 10, 448 * 2.0 ** -20])
    return torch.cat([samples, special])


@pytest.mark.parametrize("pow2", [False, True])
def test_block_scale_matches_scalar_fp32_formula(gen, pow2):
    amax = _amax_samples(gen)
    s, m = R.block_scale(amax, pow2)
    s_np, m_np = np_block_scale(as_np(amax), pow2)
    np.testing.assert_array_equal(as_np(s).view(np.uint32), s_np.view(np.uint32))
    np.testing.assert_array_equal(as_np(m).view(np.uint32), m_np.view(np.uint32))
    assert torch.isfinite(s).all() and torch.isfinite(m).all() and (s > 0).all()


def test_block_scale_single_fp32_divisions(gen):
    # torch's `448.0 / t` is reciprocal-then-multiply (two roundings); the contract is one division
    amax = torch.rand(1000, generator=gen) * 100
    _, m = R.block_scale(amax, pow2=False)
    assert not torch.equal(m, 448.0 / amax)
    np.testing.assert_array_equal(as_np(m), np.float32(448) / as_np(amax))


def test_pow2_ceil_is_exact_from_bits(gen):
    v = torch.cat([
        torch.exp2(torch.empty(5000).uniform_(-149, 127.9, generator=gen).double()).float(),
        torch.exp2(torch.arange(-149, 128).double()).float(),  # exact powers stay put
        torch.tensor([2.0 ** -149 * 3, 2.0 ** -127 * 1.5, 2.0 ** -126 * (1 - 2.0 ** -23), 3.4e38, INF, NAN]),
    ])
    got = R.pow2_ceil(v)
    with np.errstate(over="ignore"):  # 3.4e38 -> 2^128 -> Inf, in both
        want = np.array([exact_pow2_ceil(x) for x in as_np(v).astype(np.float64)], dtype=np.float32)
    np.testing.assert_array_equal(as_np(got).view(np.uint32)[:-1], want.view(np.uint32)[:-1])
    assert torch.isnan(got[-1]) and got[-3] == INF
    finite = torch.isfinite(got)
    g64, v64 = got[finite].double(), v[finite].double()
    assert (g64 >= v64).all() and (g64 / 2 < v64).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_1x128_formula_bytes(gen, pow2):
    x = random_rows(64, 384, gen, torch.float32, spread=30)
    q, s = R.quantize_1x128(x, pow2)
    xb = as_np(x).reshape(64, 3, 128)
    s_np, m_np = np_block_scale(np.abs(xb).max(-1), pow2)
    np.testing.assert_array_equal(as_np(s).view(np.uint32), s_np.view(np.uint32))
    want = e4m3_bytes((xb * m_np[..., None]).astype(np.float32)).reshape(64, 384)  # one FP32 multiply
    np.testing.assert_array_equal(as_np(qbytes(q)), want)
    if pow2:  # x * (1/s) is x / s exactly
        np.testing.assert_array_equal(want, e4m3_bytes((xb / s_np[..., None]).astype(np.float32)).reshape(64, 384))
        mant, _ = np.frexp(as_np(s))
        assert (mant == 0.5).all()


@pytest.mark.parametrize("pow2", [False, True])
def test_block_max_never_exceeds_448(gen, pow2):
    amax = torch.exp2(torch.empty(20000).uniform_(-100, 100, generator=gen).double()).float()
    _, m = R.block_scale(amax, pow2)
    x = torch.stack([amax, -amax, amax / 2], 1)  # one (partial) block per row
    q, _ = R.quantize_1x128(x, pow2)
    if not pow2:
        # amax * fl(448/amax) rounds above 448 for some amax: satfinite must clamp, never give NaN
        assert (amax * m > 448).any()
        assert (qbytes(q[:, 0]) == 0x7E).all() and (qbytes(q[:, 1]) == 0xFE).all()
    else:  # s >= amax/448 exactly: the block max lands in (224, 448]
        assert ((amax * m <= 448) & (amax * m > 224)).all()
        np.testing.assert_array_equal(as_np(qbytes(q[:, 0])), e4m3_bytes(as_np(amax * m)))


def test_amax_448_block_is_exact():
    codes = torch.arange(0x7F, dtype=torch.uint8)
    vals = torch.cat([codes, codes | 0x80]).view(FP8).float()  # every finite e4m3 value, +-448 included
    x = torch.zeros(1, 256)
    x[0, :254] = vals
    for pow2 in (False, True):
        q, s = R.quantize_1x128(x, pow2)
        assert s[0, 0].item() == 1.0 and s[0, 1].item() == 1.0
        assert torch.equal(qbytes(q[0, :254]), torch.cat([codes, codes | 0x80]))


def test_zero_blocks():
    x = torch.zeros(3, 256)
    x[1, :128] = -0.0
    x[2, 130] = 5.0
    q, s = R.quantize_1x128(x)
    assert s.tolist() == [[1.0, 1.0], [1.0, 1.0], [1.0, float(np.float32(5) / np.float32(448))]]
    b = qbytes(q)
    assert (b[0] == 0).all() and (b[1, :128] == 0x80).all() and (b[1, 128:] == 0).all()  # x * 0 keeps -0
    assert b[2, 130] == 0x7E


def test_denormal_range_amax_is_neither_flushed_nor_nan():
    # amax in [2^-119, 448 * 2^-126): s = amax/448 is an FP32 denormal and must not be flushed
    amax = torch.tensor([2.0 ** -119, 2.0 ** -118 * 1.3, 3e-36, 5e-36])
    x = torch.zeros(4, 128)
    x[:, 0], x[:, 1] = amax, -amax / 3
    q, s = R.quantize_1x128(x)
    s_np, m_np = np_block_scale(as_np(amax), False)
    assert (s[:, 0] > 0).all() and (s[:, 0] < 2.0 ** -126).all()
    np.testing.assert_array_equal(as_np(s[:, 0]), s_np)
    assert (qbytes(q[:, 0]) == 0x7E).all()
    np.testing.assert_array_equal(as_np(qbytes(q[:, 1])), e4m3_bytes(as_np(x[:, 1]) * m_np))
    assert (qbytes(q[:, 2:]) == 0).all()  # zeros stay zeros (the literal 448/amax would be Inf here: 0*Inf=NaN)


@pytest.mark.parametrize("pow2", [False, True])
def test_tiny_amax_below_the_floor(pow2):
    tiny = torch.tensor([2.0 ** -149, 2.0 ** -140, 2.0 ** -126, 2.0 ** -120])  # denormal inputs included
    x = torch.zeros(4, 128)
    x[:, 0] = tiny
    q, s = R.quantize_1x128(x, pow2)
    floor_s, floor_m = R.block_scale(torch.tensor([R.AMAX_FLOOR]), pow2)
    assert torch.equal(s[:, 0], floor_s.expand(4))
    want = e4m3_bytes(as_np(tiny) * as_np(floor_m))
    np.testing.assert_array_equal(as_np(qbytes(q[:, 0])), want)
    assert (qbytes(q[:, 1:]) == 0).all()
    if pow2:
        assert s[0, 0].item() == 2.0 ** -127  # a denormal power of two, UE8M0's smallest


# ------------------------------------------------------------------------------------------------
# NaN / Inf policy
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pow2", [False, True])
def test_nan_inf_policy_1x128(pow2):
    x = torch.ones(4, 256)
    x[0, 3], x[0, 4], x[0, 5] = INF, -INF, -2.0  # amax = Inf
    x[1, 7] = NAN  # amax = NaN
    x[2, 1], x[2, 2] = NAN, INF  # NaN wins over Inf
    x[3, 0] = -NAN
    q, s = R.quantize_1x128(x, pow2)
    b = qbytes(q)
    assert s[0, 0].item() == INF
    assert b[0, 3] == 0x7F and b[0, 4] == 0x7F  # +-Inf * 0 = NaN
    assert b[0, 5] == 0x80 and (b[0, 6:128] == 0).all() and b[0, 0] == 0  # finite -> +-0
    for row in (1, 2, 3):
        assert math.isnan(s[row, 0].item()) and (b[row, :128] == 0x7F).all()
    # the other column block of every row is untouched
    clean_q, clean_s = R.quantize_1x128(torch.ones(1, 128), pow2)
    assert (s[:, 1] == clean_s[0, 0]).all() and (b[:, 128:] == qbytes(clean_q)).all()


def test_nan_inf_policy_other_layouts():
    w = torch.ones(1, 256, 256)
    w[0, 5, 200] = NAN
    w[0, 130, 3] = INF
    q, s, qt, st = R.quantize_128x128(w)
    assert math.isnan(s[0, 0, 1].item()) and s[0, 1, 0].item() == INF and s[0, 1, 1].item() == ONE_448
    assert (qbytes(q[0, :128, 128:]) == 0x7F).all()
    assert (qbytes(q[0, 128:, :128]) == 0).sum() == 128 * 128 - 1
    x = torch.ones(300, 2)
    x[10, 0] = NAN
    x[200, 1] = INF
    qt, s = R.quantize_grouped_128x1(x, torch.tensor([150, 150]))
    assert math.isnan(s[0, 0].item()) and s[0, 1].item() == ONE_448  # block 0 of group 0, col 0 only
    assert s[2, 1].item() == INF and s[2, 0].item() == ONE_448  # rows 150..277 = block 0 of group 1
    assert (qbytes(qt[0, :128]) == 0x7F).all() and (qbytes(qt[0, 128:150]) == 0x7E).all()


def test_nan_propagates_through_the_gemms():
    x = torch.ones(4, 128)
    x[1, 5] = NAN
    q, s = R.quantize_1x128(x)
    wq, ws, _, _ = R.quantize_128x128(torch.ones(1, 16, 128))
    y = R.m_grouped_fp8_gemm(q, s, wq, ws, torch.tensor([4]))
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------
def _storage_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The whole [rows, cols] row-major storage behind a strided view."""
    return torch.as_strided(t, (rows, cols), (cols, 1), t.storage_offset())


@pytest.mark.parametrize("m", [0, 1, 5, 128, 130])
@pytest.mark.parametrize("k", [128, 200, 384])
def test_1x128_layout(gen, m, k):
    x = random_rows(m, k, gen)
    q, s = R.quantize_1x128(x)
    kb, m_pad = -(-k // 128), -(-m // 4) * 4
    assert q.shape == (m, k) and q.dtype == FP8 and q.is_contiguous()
    assert s.shape == (m, kb) and s.dtype == torch.float32 and (m == 0 or s.stride() == (1, m_pad))
    full = _storage_2d(s, kb, m_pad)
    assert s.untyped_storage().nbytes() == kb * m_pad * 4
    assert (full[:, m:] == 1.0).all()  # pad entries
    for r in range(m):  # every block's scale is its own row segment's amax (partial last block too)
        for b in range(kb):
            seg = x[r, 128 * b: 128 * (b + 1)].float()
            want, _ = R.block_scale(seg.abs().max().reshape(1), False)
            assert s[r, b].item() == want.item()


def test_1x128_partial_last_block_is_its_own_block():
    x = torch.ones(2, 200)
    x[0, 199] = 1000.0
    _, s = R.quantize_1x128(x)
    assert s[0].tolist() == [pytest.approx(1 / 448), pytest.approx(1000 / 448)]
    assert s[1].tolist() == [pytest.approx(1 / 448)] * 2


@pytest.mark.parametrize("shape", [(256, 384), (2, 200, 136), (3, 128, 128), (1, 16, 130)])
def test_128x128_layout(gen, shape):
    w = random_rows(math.prod(shape[:-1]), shape[-1], gen, spread=4).reshape(shape)
    q, s, qt, st = R.quantize_128x128(w)
    N, K = shape[-2:]
    nb, kb = -(-N // 128), -(-K // 128)
    assert q.shape == shape and s.shape == shape[:-2] + (nb, kb) and s.is_contiguous()
    assert qt.shape == shape[:-2] + (K, N) and qt.is_contiguous() and st.is_contiguous()
    assert torch.equal(qbytes(qt), qbytes(q).transpose(-1, -2)) and torch.equal(st, s.transpose(-1, -2))
    w3, s3 = w.reshape(-1, N, K), s.reshape(-1, nb, kb)
    for g in range(w3.shape[0]):
        for i in range(nb):
            for j in range(kb):
                blk = w3[g, 128 * i: 128 * (i + 1), 128 * j: 128 * (j + 1)].float()
                want, _ = R.block_scale(blk.abs().max().reshape(1), False)
                assert s3[g, i, j].item() == want.item()
    if len(shape) == 3:  # 2-D input = the same without G
        q2, s2, qt2, st2 = R.quantize_128x128(w[0])
        assert torch.equal(qbytes(q2), qbytes(q[0])) and torch.equal(s2, s[0])
        assert torch.equal(qbytes(qt2), qbytes(qt[0])) and torch.equal(st2, st[0])


# Sizes around the 16-column alignment of the wgrad layout and the 128-token blocks (docs/design.md §4).
WGRAD_EDGE = [0, 1, 15, 16, 17, 127, 128, 129]
WGRAD_GROUPINGS = {
    **{f"one_{m}": [m] for m in WGRAD_EDGE},
    "edge_sizes": WGRAD_EDGE,
    "mixed": [129, 0, 15, 0, 16, 1, 17, 127, 128, 0, 300, 33],
    "all_empty": [0, 0, 0],  # M == 0
    **{f"grouping_{k}": v for k, v in EDGE_GROUPINGS.items()},
}


def _aligned_starts(sizes):
    """a_g = sum_{h<g} round_up(M_h, 128), written out independently of the package, [G+1]."""
    starts = [0]
    for m in sizes:
        starts.append(starts[-1] + -(-m // 128) * 128)
    return starts


@pytest.mark.parametrize("name", sorted(WGRAD_GROUPINGS))
def test_grouped_128x1_layout(gen, name):
    """qt is a contiguous [K, P], P = round_up(M, 128) + 128 G; group g's tokens sit at columns [a_g, a_g + M_g), each
    128-token block quantized per column from the group's first token; every other column is zero."""
    sizes = WGRAD_GROUPINGS[name]
    M, K, num_groups = sum(sizes), 48, len(sizes)
    x = random_rows(M, K, gen)
    qt, s = R.quantize_grouped_128x1(x, torch.tensor(sizes))
    P = -(-M // 128) * 128 + 128 * num_groups
    assert qt.shape == (K, P) and qt.is_contiguous() and qt.dtype == FP8
    assert s.shape == (M // 128 + num_groups, K) and s.is_contiguous() and s.dtype == torch.float32
    starts = _aligned_starts(sizes)
    assert aligned_token_offsets(torch.tensor(sizes)).tolist() == starts and starts[-1] <= P
    written = torch.zeros(P, dtype=torch.bool)
    used, row = 0, 0
    for g, m in enumerate(sizes):  # blocks relative to each group's first row, in group order
        for j in range(0, m, 128):
            rows = x[row + j: row + min(m, j + 128)].float()
            want_s, want_m = R.block_scale(rows.abs().amax(0), False)
            assert torch.equal(s[used], want_s)
            cols = slice(starts[g] + j, starts[g] + min(m, j + 128))
            assert torch.equal(qbytes(qt[:, cols]), qbytes(R.fp8_e4m3_satfinite(rows * want_m)).t())
            used += 1
        written[starts[g]: starts[g] + m] = True
        row += m
    assert int(written.sum()) == M
    assert (qbytes(qt)[:, ~written] == 0).all()  # the gaps between groups and the tail [a_G, P)
    assert (s[used:] == 0).all()  # rows past the last block


@pytest.mark.parametrize("name", ["edge_sizes", "mixed", "all_empty", "one_0", "one_129"])
def test_grouped_128x1_layout_same_for_every_group_format(gen, name, groups_format):
    sizes = WGRAD_GROUPINGS[name]
    x = random_rows(sum(sizes), 32, gen)
    ref_q, ref_s = R.quantize_grouped_128x1(x, torch.tensor(sizes))
    num_groups = len(sizes) if groups_format[0] == "offsets" else None
    q, s = R.quantize_grouped_128x1(x, group_tensor(sizes, groups_format), num_groups=num_groups)
    assert torch.equal(qbytes(q), qbytes(ref_q)) and torch.equal(s, ref_s)
    assert torch.equal(R.dequantize_grouped_128x1(q, s, group_tensor(sizes, groups_format), num_groups=num_groups),
                       R.dequantize_grouped_128x1(ref_q, ref_s, torch.tensor(sizes)))


@pytest.mark.parametrize("num_groups", [1, 3, 256])
def test_grouped_128x1_no_tokens(num_groups):
    """M == 0 (an expert-parallel rank that received no token): qt is [K, 128 G] zeros and s [G, K] zeros."""
    qt, s = R.quantize_grouped_128x1(torch.zeros(0, 32, dtype=torch.bfloat16),
                                     torch.zeros(num_groups, dtype=torch.int32))
    assert qt.shape == (32, 128 * num_groups) and qt.is_contiguous() and not qbytes(qt).any()
    assert s.shape == (num_groups, 32) and not s.any()


def test_grouped_128x1_blocks_never_mix_groups():
    # A global 128-row blocking would put row 0 (group 0, huge) and rows 1..127 (group 1) together.
    x = torch.ones(129, 4)
    x[0] = 1e4
    _, s = R.quantize_grouped_128x1(x, torch.tensor([1, 128]))
    assert torch.allclose(s[0], torch.full((4,), 1e4 / 448)) and torch.equal(s[1], torch.full((4,), 1 / 448))
    assert (s[2:] == 0).all()


def test_grouped_128x1_rejects_bad_groups():
    with pytest.raises(ValueError, match="sum to 10, but the data has M_total=12"):
        R.quantize_grouped_128x1(torch.ones(12, 4), torch.tensor([4, 6]))


def test_empty_inputs():
    q, s = R.quantize_1x128(torch.zeros(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    qt, s = R.quantize_grouped_128x1(torch.zeros(0, 32), torch.zeros(3, dtype=torch.int64))
    assert qt.shape == (32, 384) and (qbytes(qt) == 0).all() and s.shape == (3, 32) and (s == 0).all()
    a, a_s = R.quantize_1x128(torch.zeros(0, 128, dtype=torch.bfloat16))
    wq, ws, _, _ = R.quantize_128x128(torch.ones(3, 32, 128))
    y = R.m_grouped_fp8_gemm(a, a_s, wq, ws, torch.zeros(3, dtype=torch.int32))
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16
    dyq, dys = R.quantize_grouped_128x1(torch.zeros(0, 16), torch.zeros(3, dtype=torch.int64))
    dw = R.k_grouped_fp8_gemm(dyq, dys, qt, s, torch.zeros(3, dtype=torch.int64))
    assert dw.shape == (3, 16, 32) and (dw == 0).all()
    c = torch.randn(3, 16, 32)
    assert torch.equal(R.k_grouped_fp8_gemm(dyq, dys, qt, s, torch.zeros(4, dtype=torch.int32), out=c.clone(),
                                            accumulate=True, num_groups=3), c)  # offsets [G+1], all groups empty


# ------------------------------------------------------------------------------------------------
# Dequantization round trips
# ------------------------------------------------------------------------------------------------
def _check_roundtrip(x: torch.Tensor, deq: torch.Tensor, s_elem: torch.Tensor):
    # e4m3 RNE: relative error <= 2^-4 in the normal range, absolute <= 2^-10 (half the smallest
    # subnormal 2^-9) times s below it; slack for the FP32 multiplier and the FP32 q * s.
    x = x.double()
    err = (deq.double() - x).abs()
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * s_elem.double() + 2.0 ** -20 * x.abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("pow2", [False, True])
def test_roundtrip_1x128(gen, pow2):
    x = random_rows(200, 320, gen)
    q, s = R.quantize_1x128(x, pow2)
    _check_roundtrip(x, R.dequantize_1x128(q, s), s.repeat_interleave(128, 1)[:, :320])
    assert torch.equal(R.dequantize_1x128(q, s, torch.float64),
                       q.double() * s.double().repeat_interleave(128, 1)[:, :320])


def test_roundtrip_128x128(gen):
    w = random_rows(2 * 260, 200, gen, spread=3).reshape(2, 260, 200)
    q, s, qt, st = R.quantize_128x128(w)
    s_elem = s.repeat_interleave(128, 1)[:, :260].repeat_interleave(128, 2)[..., :200]
    _check_roundtrip(w, R.dequantize_128x128(q, s), s_elem)
    assert torch.equal(R.dequantize_128x128(qt, st, torch.float64),
                       R.dequantize_128x128(q, s, torch.float64).transpose(1, 2))


def test_roundtrip_grouped_128x1(gen, dist):
    sizes = make_group_sizes(700, 6, dist, seed=5)
    x = random_rows(700, 64, gen)
    qt, s = R.quantize_grouped_128x1(x, sizes)
    deq = R.dequantize_grouped_128x1(qt, s, sizes)
    first_block = token_block_offsets(sizes).tolist()
    blocks = torch.cat([torch.arange(m) // 128 + first_block[g] for g, m in enumerate(sizes.tolist())])
    _check_roundtrip(x, deq, s[blocks])


# ------------------------------------------------------------------------------------------------
# GEMM oracle: exact semantics on small cases, accuracy on larger ones, padded == unpadded
# ------------------------------------------------------------------------------------------------
def test_fma32_is_fused_and_correctly_rounded(gen):
    a = torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-20, 20, (4000,), generator=gen).float())
    b = torch.randn(4000, generator=gen)
    c = -(a * b) * (1 + torch.randn(4000, generator=gen) * 1e-3)  # heavy cancellation
    got = R._fma32(a, b, c)
    want = [f32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    np.testing.assert_array_equal(as_np(got), np.array(want, dtype=np.float32))
    assert not torch.equal(got, a * b + c)  # unfused rounding differs: the test can tell


def _scalar_m_grouped(a, a_s, b, b_s, sizes, cols):
    """docs/design.md §3 for the given output columns with exact rationals: accumulation order and roundings.
    Returns the FP32 accumulators (as float64)."""
    M, K = a.shape
    out = torch.zeros(M, len(cols), dtype=torch.float64)
    a_v, b_v = a.double().tolist(), b.double().tolist()
    row = 0
    for g, m in enumerate(sizes):
        for r in range(row, row + m):
            for j, n in enumerate(cols):
                acc = 0.0
                for kb in range(-(-K // 128)):
                    ks = range(128 * kb, min(K, 128 * kb + 128))
                    p = f32(sum(Fraction(a_v[r][k]) * Fraction(b_v[g][n][k]) for k in ks))
                    sasb = f32(Fraction(a_s[r, kb].item()) * Fraction(b_s[g, n // 128, kb].item()))
                    acc = f32(Fraction(sasb) * Fraction(p) + Fraction(acc))
                out[r, j] = acc
        row += m
    return out


def test_m_grouped_exact_semantics(gen):
    sizes, cols = [2, 0, 3], [0, 1, 128, 129]  # two N blocks: two weight scale rows
    a, a_s = R.quantize_1x128(random_rows(5, 384, gen))
    b, b_s, _, _ = R.quantize_128x128(random_rows(3 * 130, 384, gen, spread=2).reshape(3, 130, 384))
    acc = _scalar_m_grouped(a, a_s, b, b_s, sizes, cols)
    y32 = R.m_grouped_fp8_gemm(a, a_s, b, b_s, torch.tensor(sizes), out_dtype=torch.float32)
    assert torch.equal(y32[:, cols].double(), acc)
    y = R.m_grouped_fp8_gemm(a, a_s, b, b_s, torch.tensor(sizes))  # BF16: nearest even of acc
    bf16 = acc.clone().apply_(lambda v: round_to_bits(Fraction(v), 7, -126))
    assert y.dtype == torch.bfloat16 and torch.equal(y[:, cols].double(), bf16)


def test_k_grouped_exact_semantics(gen):
    sizes = [130, 0, 5]
    M = sum(sizes)
    dy_t, dy_s = R.quantize_grouped_128x1(random_rows(M, 2, gen), torch.tensor(sizes))
    x_t, x_s = R.quantize_grouped_128x1(random_rows(M, 3, gen), torch.tensor(sizes))
    c = torch.randn(3, 2, 3, generator=gen)
    out = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, torch.tensor(sizes), out=c.clone(), accumulate=True)
    assert dy_t.shape == (2, 640) and x_t.shape == (3, 640)  # P = round_up(135, 128) + 128 * 3
    dv, xv = dy_t.double().tolist(), x_t.double().tolist()
    # (scale row, first column, end column): group 2 starts at a_2 = round_up(130, 128) + 0 = 256
    blocks = {0: [(0, 0, 128), (1, 128, 130)], 1: [], 2: [(2, 256, 261)]}
    for g in range(3):
        for n in range(2):
            for k in range(3):
                acc = 0.0
                for b, t0, t1 in blocks[g]:
                    p = f32(sum(Fraction(dv[n][t]) * Fraction(xv[k][t]) for t in range(t0, t1)))
                    sasb = f32(Fraction(dy_s[b, n].item()) * Fraction(x_s[b, k].item()))
                    acc = f32(Fraction(sasb) * Fraction(p) + Fraction(acc))
                want = c[g, n, k].item() if not blocks[g] else f32(Fraction(c[g, n, k].item()) + Fraction(acc))
                assert out[g, n, k].item() == want, (g, n, k)


def test_block_partial_sum_is_rounded_to_fp32_before_the_fma():
    # block 0 leaves acc = 2^32 (FP32 ulp 512); block 1's exact p = 256 + 2^-18 needs 27 bits. Rounded
    # to FP32 first, p = 256 and acc + p is an exact tie that rounds to even (2^32); the unrounded p
    # would tip it to 2^32 + 512.
    a = torch.zeros(1, 256)
    a[0, 0], a[0, 128], a[0, 129] = 256.0, 16.0, 2.0 ** -9
    b = a.clone().reshape(1, 1, 256)
    a_s = R.alloc_1x128_scales(1, 2)
    a_s[0, 0] = 2.0 ** 16
    y = R.m_grouped_fp8_gemm(a.to(FP8), a_s, b.to(FP8), torch.ones(1, 1, 2), torch.tensor([1]),
                             out_dtype=torch.float32)
    assert y.item() == 2.0 ** 32


def _gemm_problem(gen, sizes, n=256, k=384, num_groups=None):
    M = int(sum(sizes))
    num_groups = num_groups or len(sizes)
    a, a_s = R.quantize_1x128(random_rows(M, k, gen))
    w = random_rows(num_groups * n, k, gen, spread=3).reshape(num_groups, n, k)
    return a, a_s, R.quantize_128x128(w)


def test_m_grouped_forward_and_dgrad_accuracy(gen, dist):
    sizes = make_group_sizes(600, 5, dist, seed=11)
    a, a_s, (wq, ws, wqt, wst) = _gemm_problem(gen, sizes)
    y = R.m_grouped_fp8_gemm(a, a_s, wq, ws, sizes)
    y64 = T.m_grouped_ref64(a, a_s, wq, ws, sizes)
    assert y.shape == (600, 256) and y.dtype == torch.bfloat16
    assert T.diff(y, y64) < 1e-3  # the contract's bound
    assert T.diff(y, y64) < 1e-5  # the oracle's own error is BF16 output rounding only
    y32 = R.m_grouped_fp8_gemm(a, a_s, wq, ws, sizes, out_dtype=torch.float32)
    assert T.diff(y32, y64) < 1e-12 and torch.equal(y32.to(torch.bfloat16), y)
    # dgrad: dX = dY . W, i.e. the same call with W^T [G, K, N] and its transposed scales
    dy, dy_s = R.quantize_1x128(random_rows(600, 256, gen))
    dx = R.m_grouped_fp8_gemm(dy, dy_s, wqt, wst, sizes)
    dx64 = T.m_grouped_ref64(dy, dy_s, wqt, wst, sizes)
    assert dx.shape == (600, 384) and T.diff(dx, dx64) < 1e-5
    w64 = R.dequantize_128x128(wq, ws, torch.float64)
    offs = [0] + torch.cumsum(sizes, 0).tolist()
    direct = torch.cat([R.dequantize_1x128(dy, dy_s, torch.float64)[offs[g]:offs[g + 1]] @ w64[g]
                        for g in range(5)])
    assert T.diff(dx64, direct) < 1e-14


def test_m_grouped_edge_groups_and_formats(gen, groups_format):
    sizes = EDGE_GROUPINGS["edges_shuffled"]
    a, a_s, (wq, ws, _, _) = _gemm_problem(gen, sizes, n=128, k=256)
    y = R.m_grouped_fp8_gemm(a, a_s, wq, ws, group_tensor(sizes, groups_format))
    assert T.diff(y, T.m_grouped_ref64(a, a_s, wq, ws, torch.tensor(sizes))) < 1e-5
    assert torch.equal(y, R.m_grouped_fp8_gemm(a, a_s, wq, ws, torch.tensor(sizes)))


@pytest.mark.parametrize("align", [16, 128])
def test_m_grouped_padded_equals_unpadded(gen, align):
    sizes = torch.tensor(EDGE_GROUPINGS["edges"] + [300, 0, 77])
    x = random_rows(int(sizes.sum()), 256, gen)
    a, a_s = R.quantize_1x128(x)
    wq, ws, _, _ = R.quantize_128x128(random_rows(len(sizes) * 128, 256, gen, spread=3).reshape(-1, 128, 256))
    a_pad, a_s_pad, sizes_pad = T.pad_groups_rows(a, a_s, sizes, align)
    assert torch.equal(sizes_pad, (sizes + align - 1) // align * align)
    # padding the quantized operand == quantizing the zero-padded input (zero rows: q = 0, s = 1)
    x_pad, _, _ = T.pad_groups_rows(x, None, sizes, align)
    q2, s2 = R.quantize_1x128(x_pad)
    assert torch.equal(qbytes(q2), qbytes(a_pad)) and torch.equal(s2, a_s_pad)
    y = R.m_grouped_fp8_gemm(a, a_s, wq, ws, sizes)
    y_pad = R.m_grouped_fp8_gemm(a_pad, a_s_pad, wq, ws, sizes_pad)
    assert torch.equal(R.unpad_rows(y_pad, sizes, align), y)
    valid = R.unpad_rows(torch.arange(len(y_pad)), sizes, align)
    padding = torch.ones(len(y_pad), dtype=torch.bool).index_fill_(0, valid, False)
    assert padding.sum() == int((sizes_pad - sizes).sum()) and (y_pad[padding] == 0).all()


def _k_problem(gen, sizes, n=64, k=48):
    M = int(sum(sizes))
    dy, x = random_rows(M, n, gen), random_rows(M, k, gen)
    return dy, x, R.quantize_grouped_128x1(dy, sizes), R.quantize_grouped_128x1(x, sizes)


def test_k_grouped_accuracy_and_accumulate(gen, dist):
    sizes = make_group_sizes(700, 6, dist, seed=13)
    _, _, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, sizes)
    dw = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes)
    ref = T.k_grouped_ref64(dy_t, dy_s, x_t, x_s, sizes)
    assert dw.shape == (6, 64, 48) and dw.dtype == torch.float32
    assert T.diff(dw, ref) < 1e-3 and T.diff(dw, ref) < 1e-12
    empty = sizes == 0
    assert (dw[empty] == 0).all()
    c = torch.randn(6, 64, 48, generator=gen)
    out = c.clone()
    res = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes, out=out, accumulate=True)
    assert res is out
    assert torch.equal(out[~empty], c[~empty] + dw[~empty]) and torch.equal(out[empty], c[empty])
    poisoned = torch.full_like(c, NAN)
    R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes, out=poisoned)
    assert torch.equal(poisoned, dw)  # out= without accumulate overwrites, empty groups with 0
    bf = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes, out_dtype=torch.bfloat16)
    assert torch.equal(bf, dw.to(torch.bfloat16))


def test_k_grouped_accumulate_keeps_subnormals(gen):
    """The accumulating add is one IEEE FP32 add, rounded to nearest, subnormals kept (docs/layouts.md; the TMA
    reduce-add does the same on the H200): a subnormal C plus an exact 0 is C, not a flushed 0."""
    tiny = 2.0 ** -126  # the least normal FP32
    sizes = torch.tensor([200])
    _, _, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, sizes, n=8, k=8)
    zero = torch.zeros_like(dy_t.view(torch.uint8)).view(dy_t.dtype)  # acc exactly +0
    c = torch.tensor([[tiny / 2, -tiny / 2, tiny, -tiny, 1.5, -0.0, 0.0, tiny * (1 - 2.0 ** -23)]] * 8)
    out = R.k_grouped_fp8_gemm(zero, dy_s, x_t, x_s, sizes, out=c[None].clone(), accumulate=True)[0]
    want = c.clone()
    want[:, 5] = 0.0  # -0 + (+0) = +0 in round to nearest
    assert torch.equal(out, want) and torch.equal(torch.signbit(out), torch.signbit(want))
    assert (out[:, [0, 1, 7]] != 0).all()  # the subnormals survived


@pytest.mark.parametrize("align", [16, 128])
@pytest.mark.parametrize("name", ["grouping_edges_shuffled", "edge_sizes", "mixed", "one_17"])
def test_k_grouped_padded_equals_unpadded(gen, align, name):
    """The GEMM on the 128-aligned layout equals the padded path bit for bit: every group padded with zero tokens to
    a multiple of `align` (the quantizer run on x with zero rows inserted, the GEMM with the padded sizes)."""
    sizes = torch.tensor(WGRAD_GROUPINGS[name])
    dy, x, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, sizes)
    dy_pad, _, sizes_pad = T.pad_groups_rows(dy, None, sizes, align)
    x_pad, _, _ = T.pad_groups_rows(x, None, sizes, align)
    dyp_t, dyp_s = R.quantize_grouped_128x1(dy_pad, sizes_pad)
    xp_t, xp_s = R.quantize_grouped_128x1(x_pad, sizes_pad)
    used = int(token_block_offsets(sizes)[-1])
    assert torch.equal(dyp_s[:used], dy_s[:used]) and torch.equal(xp_s[:used], x_s[:used])  # same blocks
    dw = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes)
    assert torch.equal(R.k_grouped_fp8_gemm(dyp_t, dyp_s, xp_t, xp_s, sizes_pad), dw)
    c = torch.randn(len(sizes), 64, 48, generator=gen)
    acc = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes, out=c.clone(), accumulate=True)
    acc_pad = R.k_grouped_fp8_gemm(dyp_t, dyp_s, xp_t, xp_s, sizes_pad, out=c.clone(), accumulate=True)
    assert torch.equal(acc, acc_pad)
    bf = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes, out_dtype=torch.bfloat16)
    assert torch.equal(bf, R.k_grouped_fp8_gemm(dyp_t, dyp_s, xp_t, xp_s, sizes_pad, out_dtype=torch.bfloat16))
    ref = T.k_grouped_ref64(dy_t, dy_s, x_t, x_s, sizes)
    assert T.diff(dw, ref) < 1e-3 and T.diff(dw, ref) < 1e-12  # the contract's bound; the oracle is near exact
    assert T.diff(ref, T.k_grouped_ref64(dyp_t, dyp_s, xp_t, xp_s, sizes_pad)) < 1e-15


def test_k_grouped_reads_only_each_groups_columns(gen):
    """The reference contracts over [a_g, a_g + M_g) only: poisoning the gaps and the tail of qt (NaN) changes
    nothing. (The CUDA kernel reads a partial last block whole and relies on the quantizer's zero gaps, which give
    the same exact zero products; docs/layouts.md.)"""
    sizes = torch.tensor(WGRAD_GROUPINGS["mixed"])
    _, _, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, sizes)
    dw = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes)
    starts = _aligned_starts(sizes.tolist())
    gaps = torch.ones(dy_t.shape[1], dtype=torch.bool)
    for g, m in enumerate(sizes.tolist()):
        gaps[starts[g]: starts[g] + m] = False
    for t in (dy_t, x_t):
        qbytes(t)[:, gaps] = E4M3_NAN
    assert torch.equal(R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, sizes), dw)


@pytest.mark.parametrize("fmt", [("sizes", torch.int32), ("offsets", torch.int64)])
def test_k_grouped_num_groups_and_out_give_g(gen, fmt):
    """G comes from out, else num_groups, else the groups hold sizes [G]; offsets [G+1] need one of the first two."""
    sizes = [129, 0, 15, 17]
    _, _, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, torch.tensor(sizes))
    want = R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, torch.tensor(sizes))
    groups = group_tensor(sizes, fmt)
    assert torch.equal(R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, groups, num_groups=4), want)
    out = torch.full_like(want, NAN)
    assert R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, groups, out=out) is out and torch.equal(out, want)
    assert torch.equal(T.k_grouped_ref64(dy_t, dy_s, x_t, x_s, groups, num_groups=4),
                       T.k_grouped_ref64(dy_t, dy_s, x_t, x_s, torch.tensor(sizes)))
    if fmt[0] == "offsets":  # read as 5 sizes: they need more columns than P holds
        with pytest.raises(ValueError, match=r"wgrad operands have P = 768 \(offsets \[G\+1\] need num_groups"):
            R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, groups)
    with pytest.raises(ValueError, match="out holds 4 groups but num_groups=3"):
        R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, groups, out=out, num_groups=3)


def test_gemm_argument_errors(gen):
    a, a_s, (wq, ws, _, _) = _gemm_problem(gen, [3, 2], n=16, k=256)
    with pytest.raises(ValueError, match=r"K differs"):
        R.m_grouped_fp8_gemm(a[:, :128], a_s[:, :1], wq, ws, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"a_s must be \[M, ceil\(K/128\)\] = \(5, 2\), got \(5, 1\)"):
        R.m_grouped_fp8_gemm(a, a_s[:, :1], wq, ws, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"groups has 4 entries: expected G sizes or G\+1 offsets with G=2"):
        R.m_grouped_fp8_gemm(a, a_s, wq, ws, torch.tensor([3, 2, 0, 0]))
    with pytest.raises(TypeError, match=r"a must have dtype float8_e4m3fn, got bfloat16"):
        R.m_grouped_fp8_gemm(a.bfloat16(), a_s, wq, ws, torch.tensor([3, 2]))
    _, _, (dy_t, dy_s), (x_t, x_s) = _k_problem(gen, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"accumulate=True needs out="):
        R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, torch.tensor([3, 2]), accumulate=True)
    with pytest.raises(ValueError, match=r"out must be \[G, N, K\] = \(2, 64, 48\)"):
        R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s, torch.tensor([3, 2]), out=torch.zeros(2, 48, 64))
    with pytest.raises(ValueError, match=r"x_t is \[K, P\] = \(48, 32\): P differs"):
        R.k_grouped_fp8_gemm(dy_t, dy_s, x_t[:, :32], x_s, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"dy_s and x_s must be \[MB, N\] and \[MB, K\] with one MB"):
        R.k_grouped_fp8_gemm(dy_t, dy_s, x_t, x_s[:1], torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"round_up\(M_g, 128\) = 256 token columns, but the wgrad operands have P = 32"):
        R.k_grouped_fp8_gemm(dy_t[:, :32], dy_s, x_t[:, :32], x_s, torch.tensor([3, 20]))
    with pytest.raises(ValueError, match=r"3 token blocks, but the token-block scales have 2 rows"):
        R.dequantize_grouped_128x1(x_t, x_s, torch.tensor([1, 1, 1]))  # 384 columns fit P = 384, 3 blocks do not
    with pytest.raises(ValueError, match=r"y_pad has 5 rows, but the groups padded to 16 have 32"):
        R.unpad_rows(torch.zeros(5, 4), torch.tensor([3, 2]), 16)


# ------------------------------------------------------------------------------------------------
# diff
# ------------------------------------------------------------------------------------------------
def test_diff(gen):
    x = torch.randn(100, generator=gen)
    assert T.diff(x, x) == 0.0
    assert T.diff(x, -x) == pytest.approx(2.0)
    assert T.diff(x, torch.zeros(100)) == pytest.approx(1.0)
    assert T.diff(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert T.diff(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 5.0])) == pytest.approx(1 - 2 * 29 / (25 + 34))
    y = x.clone()
    y[7] = NAN
    assert math.isnan(T.diff(x, y))
    assert math.isnan(T.diff(torch.zeros(3), torch.zeros(3)))  # all-zero output is a failure, not a pass
    assert T.diff(x.bfloat16(), x) < 1e-4 and T.diff(x.bfloat16(), x) > 0
    with pytest.raises(ValueError, match=r"diff: shapes differ, \(100,\) vs \(10, 10\)"):
        T.diff(x, x.reshape(10, 10))


def test_diff_in_slices_is_the_whole_tensors_diff(gen, monkeypatch):
    """diff sums in slices of the flattened tensors (a layer's FP32 weight gradient would be several 8 GB copies in
    float64): a slice that does not divide the length gives the one-pass float64 value, 0 on equal tensors, NaN
    when a NaN lies in a later slice."""
    x = torch.randn(37, 11, generator=gen)
    y = x + 1e-3 * torch.randn(37, 11, generator=gen)
    x64, y64 = x.double(), y.double()
    whole = float(1.0 - 2.0 * (x64 * y64).sum() / ((x64 * x64).sum() + (y64 * y64).sum()))
    monkeypatch.setattr(T, "_DIFF_SLICE", 50)  # 407 elements: 9 slices, the last of 7
    assert T.diff(x, y) == pytest.approx(whole, rel=1e-12) and T.diff(x, y) > 0
    assert T.diff(x, x) == 0.0
    y = x.clone()
    y[-1, -1] = NAN
    assert math.isnan(T.diff(x, y))
