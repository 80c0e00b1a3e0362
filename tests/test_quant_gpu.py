"""CUDA FP8 quantizers on the H200: every output byte (padding included) equal to megatron_tma.reference on
fresh data, both scale modes, bf16 and fp16, edge shapes and groupings, the NaN/Inf policy, CUDA-graph
replay with new group sizes, no host synchronisation, torch.compile. Skipped without a Hopper GPU + extension.
"""
import pytest
import torch
from _dists import EDGE_GROUPINGS, GROUP_FORMATS, double_rounding_block, group_tensor, make_group_sizes, random_rows

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma.quant import (quantize_1x128, quantize_1x128_and_grouped_128x1, quantize_128x128,
                                quantize_128x128_from_master, quantize_grouped_128x1)

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"
INF, NAN = float("inf"), float("nan")
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def poison_allocations(*nbytes):
    """Fill caching-allocator blocks of these sizes with 0x7f bytes (e4m3 NaN, FP32 3.4e38) and free them:
    the op's outputs of the same sizes most likely reuse them, so a byte the kernel forgets to write shows."""
    blocks = [torch.full((n,), 0x7F, dtype=torch.uint8, device=DEV) for n in nbytes if n > 0]
    del blocks


def storage_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The whole row-major [rows, cols] storage behind a strided view (padding included)."""
    return torch.as_strided(t, (rows, cols), (cols, 1), t.storage_offset())


def assert_same_layout(out: torch.Tensor, ref: torch.Tensor):
    """dtype, shape and strides (those of size-1 dims are meaningless and not compared)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    assert all(a == b for a, b, n in zip(out.stride(), ref.stride(), out.shape) if n > 1), (out.stride(), ref.stride())


def assert_fp8_equal(out: torch.Tensor, ref: torch.Tensor):
    assert out.dtype == torch.float8_e4m3fn and out.device.type == "cuda"
    assert_same_layout(out, ref)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), _first_diff(out.view(torch.uint8), ref.view(torch.uint8))


def assert_scales_equal(out: torch.Tensor, ref: torch.Tensor):
    """Bit equality; NaN scales (the NaN policy) only need to be NaN in both, their payload is not pinned."""
    assert out.dtype == torch.float32
    assert_same_layout(out, ref)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    zero = torch.zeros((), device=out.device)
    a, b = torch.where(nan, zero, out).view(torch.int32), torch.where(nan, zero, ref).view(torch.int32)
    assert torch.equal(a, b), _first_diff(a, b)


def _first_diff(a, b):
    idx = (a != b).nonzero()
    if idx.numel() == 0:
        return "equal"
    i = tuple(idx[0].tolist())
    return f"{idx.shape[0]} differences, first at {i}: got {a[i].item()}, expected {b[i].item()}"


def special_rows(m: int, k: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Random rows with per-row magnitudes, then hand-made blocks: a zero block, exact +-448, values
    far beyond 448, a constant block, denormal-range rows and (bf16) rows near the amax floor 2^-119."""
    x = random_rows(m, k, gen, torch.float32, spread=6 if dtype == torch.float16 else 20)
    if m >= 8 and k >= 32:
        x[0, : min(k, 128)] = 0.0                   # an all-zero block (scale 1, data 0)
        x[1, :16] = torch.tensor([448.0, -448.0] * 8)  # amax exactly 448: scale 1
        x[2, 5] = 3.0e4                             # one huge value dominating its block
        x[3, :] = -0.0                              # negative zeros keep their sign
        x[4, :] = 1.0
        tiny = 2.0 ** -130 if dtype == torch.bfloat16 else 2.0 ** -20
        x[5] = torch.randn(k, generator=gen) * tiny  # denormal range (bf16: below the amax floor)
        x[6, ::3] = 0.0
        if dtype == torch.bfloat16:
            x[7] = torch.randn(k, generator=gen) * 2.0 ** 100
    return x.to(dtype).to(DEV)


def expected_1x128_storage(m, k):
    return -(-k // 128), -(-m // 4) * 4


# ------------------------------------------------------------------------------------------------
# 1x128
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("m,k", [(1, 16), (3, 112), (8, 128), (13, 400), (127, 256), (129, 2064), (1000, 7168), (4099, 1024)])
def test_1x128_matches_reference(gen, dtype, pow2, m, k):
    x = special_rows(m, k, gen, dtype)
    kb, m_pad = expected_1x128_storage(m, k)
    poison_allocations(m * k, kb * m_pad * 4)
    q, s = quantize_1x128(x, pow2, backend="cuda")
    rq, rs = R.quantize_1x128(x, pow2)
    assert_fp8_equal(q, rq)
    assert_scales_equal(s, rs)
    assert_scales_equal(storage_2d(s.t(), kb, m_pad), storage_2d(rs.t(), kb, m_pad))  # pad entries 1.0


def test_1x128_empty():
    q, s = quantize_1x128(torch.zeros(0, 256, dtype=torch.bfloat16, device=DEV), backend="cuda")
    assert q.shape == (0, 256) and s.shape == (0, 2)


# ------------------------------------------------------------------------------------------------
# 128x128
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("shape", [(1, 16, 16), (1, 128, 128), (2, 144, 272), (3, 400, 128), (5, 256, 1040), (4, 1024, 4096)])
def test_128x128_matches_reference(gen, dtype, pow2, shape):
    g, n, k = shape
    w = special_rows(g * n, k, gen, dtype).view(g, n, k)
    nb, kb = -(-n // 128), -(-k // 128)
    poison_allocations(g * n * k, g * nb * kb * 4, g * k * n, g * kb * nb * 4)
    out = quantize_128x128(w, pow2, backend="cuda")
    ref = R.quantize_128x128(w, pow2)
    for o, r in zip(out, ref):
        (assert_fp8_equal if r.dtype == torch.float8_e4m3fn else assert_scales_equal)(o, r)


@pytest.mark.parametrize("shape", [(1, 16, 16), (2, 144, 272), (3, 400, 128), (5, 256, 1040), (7, 2048, 768),
                                   (1000, 32, 48)])
def test_transpose_128x128_is_the_quantizers_transposed_copy(gen, shape):
    """W^T's copy made from W's by the transpose kernel (for keep_transposed_weight=False's backward): the bytes and
    scales quantize_128x128 writes as qt and st, every one of them (outputs poisoned), partial tiles and many small
    groups (more tiles than the persistent grid holds) included; and the reference's."""
    g, n, k = shape
    w = special_rows(g * n, k, gen, torch.bfloat16).view(g, n, k)
    q, s, qt, st = quantize_128x128(w, backend="cuda")
    poison_allocations(g * k * n, s.numel() * 4)
    qt2, st2 = torch.ops.megatron_tma.transpose_128x128(q, s)
    assert_fp8_equal(qt2, qt)
    assert_scales_equal(st2, st)
    ref_qt, ref_st = R.transpose_128x128(q, s)
    assert_fp8_equal(qt2, ref_qt)
    assert_scales_equal(st2, ref_st)


@pytest.mark.parametrize("transposed", [True, False], ids=["with_wt", "w_only"])
@pytest.mark.parametrize("shape", [(2, 144, 272), (5, 256, 1040), (1000, 32, 48)])
def test_128x128_refresh_writes_or_skips_on_the_device(gen, shape, transposed):
    """quantize_128x128_refresh (megatron_tma.weight_refresh): with done != version the quantizer's bytes in the given
    buffers (W's copy only when qt/st are None) and done = version; with done == version nothing is written."""
    refresh = torch.ops.megatron_tma.quantize_128x128_refresh
    g, n, k = shape
    w = special_rows(g * n, k, gen, torch.bfloat16).view(g, n, k)
    ref = quantize_128x128(w, backend="cuda")
    bufs = [torch.full_like(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, 0x7F).view(t.dtype)
            for t in ref]
    if not transposed:
        bufs[2] = bufs[3] = None
    version = torch.tensor(5, device=DEV)
    done = torch.tensor(5, device=DEV)
    refresh(w, False, *bufs, version, done)  # equal: a launch that exits
    assert all(torch.equal(b.view(torch.uint8), torch.full_like(b.view(torch.uint8), 0x7F))
               for b in bufs if b is not None and b.dtype == torch.float8_e4m3fn)
    assert all(torch.equal(b, torch.full_like(b, 0x7F)) for b in bufs if b is not None and b.dtype == torch.float32)
    assert int(done) == 5
    done.fill_(-1)
    refresh(w, False, *bufs, version, done)
    assert int(done) == 5
    for b, r in zip(bufs, ref):
        if b is not None:
            (assert_fp8_equal if r.dtype == torch.float8_e4m3fn else assert_scales_equal)(b, r)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(2, 144, 272), (5, 256, 1040), (1000, 32, 48), (3, 1536, 2048)])
def test_128x128_from_master_is_the_bf16_roundings_quantization(gen, shape, pow2):
    """quantize_128x128_from_master (FP32 masters, megatron_tma.released_weights): byte for byte the CUDA quantizer of
    the masters' BF16 rounding, on values that round (random FP32 mantissas, exact ties to even, values that round up
    into the next binade, a block where the rounding decides an FP8 byte) and partial edge blocks, and the
    reference's."""
    g, n, k = shape
    master = torch.randn(g, n, k, generator=gen) * torch.exp2(torch.randint(-20, 20, (g, n, 1), generator=gen).float())
    bits = master.view(torch.int32)
    ties = torch.rand(master.shape, generator=gen) < 0.1  # low 16 bits exactly half an ulp of BF16: ties to even
    bits[ties] = (bits[ties] & ~0xFFFF) | 0x8000
    up = torch.rand(master.shape, generator=gen) < 0.05  # mantissas of all ones: rounding carries into the exponent
    bits[up] = bits[up] | 0x7FFFFF
    if n >= 128 and k >= 128:  # a block where the BF16 rounding changes an FP8 byte (the FP32 value rounds up)
        master[:1, :128, :128] = double_rounding_block()
    master = master.to(DEV)
    got = quantize_128x128_from_master(master, pow2, backend="cuda")
    assert n < 128 or k < 128 or float(got[0][0, 1, 1]) == 1.0
    for want in (quantize_128x128(master.bfloat16(), pow2, backend="cuda"),
                 quantize_128x128_from_master(master, pow2, backend="reference")):
        for u, v in zip(got, want):
            (assert_fp8_equal if v.dtype == torch.float8_e4m3fn else assert_scales_equal)(u, v)


def test_transpose_128x128_refuses_what_it_cannot_read():
    op = torch.ops.megatron_tma.transpose_128x128
    q = torch.zeros(2, 32, 48, dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.ones(2, 1, 1, device=DEV)
    with pytest.raises(ValueError, match=r"s must be a contiguous \[G, ceil\(N/128\), ceil\(K/128\)\]"):
        op(q, s[:, :, :0])
    with pytest.raises(ValueError, match="multiples of 16"):
        op(torch.zeros(2, 24, 48, dtype=torch.float8_e4m3fn, device=DEV), s)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        op(q.view(torch.uint8), s)


def test_128x128_two_dimensional_weight(gen):
    w = special_rows(272, 400, gen, torch.bfloat16)
    for o, r in zip(quantize_128x128(w, backend="cuda"), R.quantize_128x128(w)):
        assert o.dim() == 2
        (assert_fp8_equal if r.dtype == torch.float8_e4m3fn else assert_scales_equal)(o, r)


# ------------------------------------------------------------------------------------------------
# Per-group 128x1
# ------------------------------------------------------------------------------------------------
# The wgrad layout (docs/design.md §4, 128-token group starts), written out here independently of the reference:
# qt is [K, P] contiguous, P = round_up(M, 128) + 128 G; group g's tokens at columns [a_g, a_g + M_g),
# a_g = sum_{h<g} round_up(M_h, 128); every other column (the gap after each group, the tail [a_G, P)) is 0.
def wgrad_pitch(m: int, num_groups: int) -> int:
    return -(-m // 128) * 128 + 128 * num_groups


def aligned_starts(sizes):
    """[a_0, ..., a_G] as host ints."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 128) * 128)
    return starts


def assert_wgrad_columns(qt: torch.Tensor, sizes, k: int):
    """qt is [K, P] contiguous and every column that holds no token is zero (gaps and tail)."""
    P = wgrad_pitch(sum(sizes), len(sizes))
    assert qt.dtype == torch.float8_e4m3fn and qt.shape == (k, P) and qt.is_contiguous(), (qt.shape, qt.stride())
    token = torch.zeros(P, dtype=torch.bool)
    for a, n in zip(aligned_starts(sizes), sizes):
        token[a : a + n] = True
    assert not qt.view(torch.uint8)[:, ~token.to(qt.device)].any(), "a gap or tail column is not zero"


def assert_group_placement(qt: torch.Tensor, s: torch.Tensor, x: torch.Tensor, sizes, pow2=False):
    """Group g's columns [a_g, a_g + M_g) and scale rows [B_g, B_g + ceil(M_g/128)) hold the group quantized on its
    own (which starts at column 0 and scale row 0 in any layout): checks a_g and B_g without the reference's
    multi-group code."""
    o = b = 0
    for a, n in zip(aligned_starts(sizes), sizes):
        nb = -(-n // 128)
        if n:
            one = torch.tensor([n], dtype=torch.int64, device=x.device)
            gqt, gs = R.quantize_grouped_128x1(x[o : o + n], one, pow2)
            got, want = qt.view(torch.uint8)[:, a : a + n], gqt.view(torch.uint8)[:, :n]
            assert torch.equal(got, want), _first_diff(got, want)
            assert_scales_equal(s[b : b + nb], gs[:nb])
        o, b = o + n, b + nb


def run_grouped(x, sizes, fmt=("sizes", torch.int64), pow2=False):
    groups = group_tensor(sizes, fmt, DEV)
    num_groups = len(sizes) if fmt[0] == "offsets" else None
    m, k = x.shape
    poison_allocations(k * wgrad_pitch(m, len(sizes)), (m // 128 + len(sizes)) * k * 4)
    qt, s = quantize_grouped_128x1(x, groups, pow2, num_groups=num_groups, backend="cuda")
    rqt, rs = R.quantize_grouped_128x1(x, groups, pow2, num_groups=num_groups)
    assert_wgrad_columns(qt, sizes, k)
    assert_fp8_equal(qt, rqt)  # the whole [K, P]: gaps and tail included
    assert_scales_equal(s, rs)  # unused rows 0
    return qt, s


def run_fused(x, sizes, pow2=False, fmt=("offsets", torch.int32)):
    m, k = x.shape
    groups = group_tensor(sizes, fmt, DEV)
    num_groups = len(sizes) if fmt[0] == "offsets" else None
    kb, m_pad = -(-k // 128), -(-m // 4) * 4
    poison_allocations(m * k, kb * m_pad * 4, k * wgrad_pitch(m, len(sizes)), (m // 128 + len(sizes)) * k * 4)
    q, s, qt, s_t = quantize_1x128_and_grouped_128x1(x, groups, pow2, num_groups=num_groups, backend="cuda")
    rq, rs = R.quantize_1x128(x, pow2)
    rqt, rs_t = R.quantize_grouped_128x1(x, groups, pow2, num_groups=num_groups)
    assert_fp8_equal(q, rq)
    assert_scales_equal(storage_2d(s.t(), kb, m_pad), storage_2d(rs.t(), kb, m_pad))
    assert_scales_equal(s, rs)
    assert_wgrad_columns(qt, sizes, k)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(s_t, rs_t)
    return qt, s_t


@pytest.mark.parametrize("name", sorted(EDGE_GROUPINGS))
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
def test_grouped_edge_groupings(gen, name, pow2):
    sizes = EDGE_GROUPINGS[name]
    run_grouped(special_rows(sum(sizes), 272, gen, torch.bfloat16), sizes, pow2=pow2)


@pytest.mark.parametrize("fmt", GROUP_FORMATS, ids=lambda f: f"{f[0]}-{str(f[1]).replace('torch.', '')}")
def test_grouped_every_group_format(gen, fmt):
    sizes = [0, 1, 127, 128, 129, 0, 300, 7]
    run_grouped(special_rows(sum(sizes), 144, gen, torch.bfloat16), sizes, fmt)


# Group sizes around a 16-column chunk and a 128-token block: the gaps after the groups are 127, 113, 112, 111, 1,
# 0, 127, 1, 0, 127, 125 columns, and empty groups take none (also first and last).
PLACEMENT_SIZES = [0, 1, 15, 16, 17, 127, 128, 129, 0, 255, 256, 257, 3, 0]


@pytest.mark.parametrize("fmt", GROUP_FORMATS, ids=lambda f: f"{f[0]}-{str(f[1]).replace('torch.', '')}")
@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
def test_grouped_aligned_group_starts(gen, fmt, fused):
    sizes = PLACEMENT_SIZES
    x = special_rows(sum(sizes), 272, gen, torch.bfloat16)
    qt, s = run_fused(x, sizes, fmt=fmt) if fused else run_grouped(x, sizes, fmt)
    assert_group_placement(qt, s, x, sizes)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("m,k,g,dist", [(1000, 1024, 8, "paper"), (3001, 208, 32, "with_empty"), (20000, 2048, 32, "paper"),
                                        (4096, 512, 4, "one_group"), (5000, 256, 256, "skewed"), (2000, 128, 256, "with_empty")])
def test_grouped_distributions(gen, dtype, pow2, m, k, g, dist):
    sizes = make_group_sizes(m, g, dist, seed=m + g).tolist()
    x = special_rows(m, k, gen, dtype)
    qt, s = run_grouped(x, sizes, pow2=pow2)
    if g <= 32:
        assert_group_placement(qt, s, x, sizes, pow2)


def test_grouped_every_start_alignment(gen):
    # groups ending at every residue mod 16 and mod 128 (gaps of 127..0 columns), blocks ending at every residue
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 143, 129, 130, 131, 255, 257, 0, 1]
    x = special_rows(sum(sizes), 64, gen, torch.bfloat16)
    qt, s = run_grouped(x, sizes)
    assert_group_placement(qt, s, x, sizes)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("case", ["edges", "alignments", "paper", "g256", "empty"])
def test_fused_1x128_and_grouped_matches_reference(gen, dtype, pow2, case):
    sizes, k = {
        "edges": ([0, 1, 127, 128, 129], 272),
        "alignments": ([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 0, 610], 64),
        "paper": (make_group_sizes(20000, 32, "paper", seed=7).tolist(), 2048),
        "g256": (make_group_sizes(5000, 256, "with_empty", seed=8).tolist(), 144),
        "empty": ([0, 0, 0], 32),
    }[case]
    run_fused(special_rows(sum(sizes), k, gen, dtype), sizes, pow2)


# The grouped kernels cut each column block into slots (token blocks, then pieces of the zero tail) that own
# consecutive 16-byte chunks of every qt row, and quantize runs of consecutive slots per CTA: a slot parks the
# unfinished 128-byte line of each row in shared memory and a later slot of the run completes it, so only a
# run's first and last line are written in part. The run length is a launch heuristic (1 on small inputs), so
# force each length (1000: one run per column block). With 128-token group starts and P a multiple of 128 every
# slot owns whole lines (the parking path is kept for the line grid the kernel does not assume); the layouts still
# cover groups smaller than a chunk, empty groups (also last), and runs that end inside the tail.
RESIDUES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 143, 129, 130, 131, 255, 257, 0, 1]
RUN_LAYOUTS = {
    "residues": RESIDUES + [0],
    "residues_p128": RESIDUES + [34],
    "tiny": [1] * 20 + [3, 0, 2, 16, 16, 5, 0, 0, 300, 0],
    "tiny_p128": [1] * 20 + [3, 0, 2, 16, 16, 5, 0, 0, 300, 1, 1, 19, 98],
    "paper": make_group_sizes(9000, 16, "paper", seed=11).tolist(),
    "paper_p128": make_group_sizes(8960, 16, "paper", seed=12).tolist(),
}


@pytest.mark.parametrize("run", [1, 2, 3, 8, 1000])
@pytest.mark.parametrize("layout", sorted(RUN_LAYOUTS))
@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
def test_grouped_runs_of_slots(gen, monkeypatch, run, layout, fused):
    monkeypatch.setenv("MEGATRON_TMA_QUANT_RUN", str(run))
    sizes = RUN_LAYOUTS[layout]
    pitch = wgrad_pitch(sum(sizes), len(sizes))
    assert pitch % 128 == 0  # the 128-token layout: every row starts on a line, every slot owns whole lines
    x = special_rows(sum(sizes), 272, gen, torch.bfloat16)
    run_fused(x, sizes) if fused else run_grouped(x, sizes)


@pytest.mark.parametrize("num_groups", [3500, 8192])
@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
def test_grouped_many_groups(gen, num_groups, fused):
    # The group arrays live in dynamic shared memory (12 bytes per group) next to ~35 KB of static shared
    # memory: from G ~ 1000 the launch needs the opt-in limit above 48 KB, at the maximum G as well.
    sizes = make_group_sizes(6000, num_groups, "with_empty", seed=num_groups).tolist()
    x = special_rows(sum(sizes), 32, gen, torch.bfloat16)
    run_fused(x, sizes) if fused else run_grouped(x, sizes)


@pytest.mark.parametrize("fmt", GROUP_FORMATS, ids=lambda f: f"{f[0]}-{str(f[1]).replace('torch.', '')}")
@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
def test_grouped_empty_tokens(fmt, fused):
    # M == 0 is still a launch: qt [K, 128 G] and s [G, K] are all zeros, written by the kernel (poisoned first).
    G, k = 3, 272
    x = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    groups = group_tensor([0] * G, fmt, DEV)
    num_groups = G if fmt[0] == "offsets" else None
    poison_allocations(k * 128 * G, G * k * 4)
    if fused:
        q, s1, qt, s = quantize_1x128_and_grouped_128x1(x, groups, num_groups=num_groups, backend="cuda")
        assert q.shape == (0, k) and s1.shape == (0, 3)
    else:
        qt, s = quantize_grouped_128x1(x, groups, num_groups=num_groups, backend="cuda")
    assert qt.shape == (k, 128 * G) and qt.is_contiguous() and not qt.view(torch.uint8).any()
    assert s.shape == (G, k) and not s.view(torch.int32).any()
    rqt, rs = R.quantize_grouped_128x1(x, groups, num_groups=num_groups)
    assert_fp8_equal(qt, rqt)
    assert_scales_equal(s, rs)


# ------------------------------------------------------------------------------------------------
# NaN / Inf policy
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
def test_nan_inf_policy(pow2):
    x = torch.ones(300, 256)
    x[0, 3], x[0, 4], x[0, 5] = INF, -INF, -2.0  # amax = Inf: finite -> +-0, +-Inf -> NaN
    x[1, 7] = NAN
    x[2, 1], x[2, 2] = NAN, INF                  # NaN wins over Inf
    x[3, 0] = -NAN
    x[200, 130] = -INF
    x = x.bfloat16().to(DEV)
    q, s = quantize_1x128(x, pow2, backend="cuda")
    rq, rs = R.quantize_1x128(x, pow2)
    assert_fp8_equal(q, rq)
    assert_scales_equal(s, rs)
    for o, r in zip(quantize_128x128(x[:288].view(2, 144, 256), pow2, backend="cuda"),
                    R.quantize_128x128(x[:288].view(2, 144, 256), pow2)):
        (assert_fp8_equal if r.dtype == torch.float8_e4m3fn else assert_scales_equal)(o, r)
    # group 0 (3 rows) has NaN and Inf blocks: its 125 gap columns must still be zero bytes, not q(0 * NaN)
    run_grouped(x, [3, 150, 147], pow2=pow2)
    run_fused(x, [3, 150, 147], pow2=pow2)


# ------------------------------------------------------------------------------------------------
# CUDA graphs, host synchronisation, torch.compile
# ------------------------------------------------------------------------------------------------
def test_cuda_graph_replay_with_new_sizes(gen):
    m, k, g = 1000, 256, 8
    x = special_rows(m, k, gen, torch.bfloat16)
    sizes = torch.full((g,), m // g, dtype=torch.int32, device=DEV)

    def step():
        return quantize_grouped_128x1(x, sizes, backend="cuda"), quantize_1x128(x, backend="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (qt, s), (q, s1) = step()

    for new in ([1000] + [0] * 7, [0, 1, 127, 128, 129, 0, 300, 315], [0] * 7 + [1000], [3] * 7 + [979]):
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rqt, rs = R.quantize_grouped_128x1(x, sizes)
        assert_wgrad_columns(qt, new, k)  # the previous replay's tokens in this one's gaps are overwritten
        assert_fp8_equal(qt, rqt)
        assert_scales_equal(s, rs)
        rq, rs1 = R.quantize_1x128(x)
        assert_fp8_equal(q, rq)
        assert_scales_equal(s1, rs1)


def test_no_host_synchronisation(gen):
    x = special_rows(700, 256, gen, torch.bfloat16)
    sizes = torch.tensor([0, 200, 1, 499], dtype=torch.int64, device=DEV)
    offsets = torch.tensor([0, 0, 200, 201, 700], dtype=torch.int32, device=DEV)
    w = special_rows(256, 512, gen, torch.bfloat16).view(2, 128, 512)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode does catch a host read
            sizes.sum().item()
        quantize_1x128(x, backend="cuda")
        quantize_1x128(x, True, backend="cuda")
        quantize_128x128(w, backend="cuda")
        quantize_grouped_128x1(x, sizes, backend="cuda")
        quantize_grouped_128x1(x, offsets, True, num_groups=4, backend="cuda")
        quantize_1x128_and_grouped_128x1(x, sizes, backend="cuda")
        quantize_grouped_128x1(x[:0], sizes * 0, backend="cuda")  # M == 0: P from M and G alone
        quantize_1x128_and_grouped_128x1(x[:0], offsets * 0, num_groups=4, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_empty_tokens_in_a_cuda_graph():
    """M == 0 captured: every replay writes qt [K, 128 G] and s [G, K] as zeros (filled with 0x7f in between)."""
    k, g = 160, 5
    x = torch.zeros(0, k, dtype=torch.bfloat16, device=DEV)
    sizes = torch.zeros(g, dtype=torch.int64, device=DEV)

    def step():
        return (quantize_grouped_128x1(x, sizes, backend="cuda"),
                quantize_1x128_and_grouped_128x1(x, sizes, backend="cuda"))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (qt, s), (_, _, qt2, s2) = step()
    for _ in range(2):
        for t in (qt, qt2, s, s2):
            t.view(torch.uint8).fill_(0x7F)
        graph.replay()
        torch.cuda.synchronize()
        for t, shape in ((qt, (k, 128 * g)), (qt2, (k, 128 * g)), (s, (g, k)), (s2, (g, k))):
            assert t.shape == shape and t.is_contiguous() and not t.view(torch.uint8).any()


def test_torch_compile_traces_the_ops(gen):
    """The fake implementations give torch.compile the ops' shapes and strides (fullgraph: no break)."""
    x = special_rows(300, 256, gen, torch.bfloat16)
    w = special_rows(256, 384, gen, torch.bfloat16).view(2, 128, 384)
    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int64, device=DEV)
    ops = _ext.ops()

    def step(x, w, offsets):
        return (ops.quantize_1x128(x, False), ops.quantize_128x128(w, True), ops.quantize_grouped_128x1(x, offsets, 3, False),
                ops.quantize_1x128_and_grouped_128x1(x, offsets, 3, True))

    eager = step(x, w, offsets)
    compiled = torch.compile(step, fullgraph=True)(x, w, offsets)
    for e, c in zip(torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(compiled)):
        (assert_fp8_equal if e.dtype == torch.float8_e4m3fn else assert_scales_equal)(c, e)
    qt, s = torch.compile(lambda x, g: quantize_grouped_128x1(x, g, num_groups=3))(x, offsets)
    assert_fp8_equal(qt, eager[2][0])
    assert_scales_equal(s, eager[2][1])
