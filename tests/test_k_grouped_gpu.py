"""K-grouped (weight-gradient) FP8 GEMM on the H200, on the 128-aligned wgrad layout (docs/design.md §4: group g's tokens
at columns [a_g, a_g + M_g) of [rows, P], a_g = sum_{h<g} round_up(M_h, 128), zeros between groups): bit-exact against
each group padded with zero tokens to a multiple of 128, accurate against float64, nothing past a_G read, accumulate mode,
determinism, graphs, no host sync. Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext, quant
from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma.gemm import k_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
DEV = "cuda"


def _pad_tokens(x, sizes, align=128):
    chunks, padded = [], []
    for part, s in zip(torch.split(x, sizes.tolist()), sizes.tolist()):
        p = -(-s // align) * align
        chunks.append(torch.cat([part, part.new_zeros(p - s, x.shape[1])]))
        padded.append(p)
    return torch.cat(chunks), torch.tensor(padded, dtype=torch.int64)


def _operands(sizes, n, k, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    m = int(sizes.sum())
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    dy = (torch.randn(m, n, generator=gen, device=DEV) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen, device=DEV).float())).bfloat16()
    return x, dy


def _quantized(x, dy, sizes):
    g = sizes.to(DEV)
    xt, xs = R.quantize_grouped_128x1(x, g)
    dyt, dys = R.quantize_grouped_128x1(dy, g)
    return dyt, dys, xt, xs, g


def _check(sizes, n, k, seed):
    """FP32 and BF16 outputs on the aligned layout equal the padded-to-128 layout's (every group padded with zero
    tokens, quantized and multiplied with the padded sizes), bit for bit."""
    x, dy = _operands(sizes, n, k, seed)
    args = _quantized(x, dy, sizes)
    assert args[0].shape[1] == -(-int(sizes.sum()) // 128) * 128 + 128 * len(sizes)  # P
    out = torch.full((len(sizes), n, k), float("nan"), device=DEV)
    k_grouped_fp8_gemm(*args, out=out)
    xp, padded = _pad_tokens(x, sizes)
    dyp, _ = _pad_tokens(dy, sizes)
    padded_args = _quantized(xp, dyp, padded)
    ref_pad = k_grouped_fp8_gemm(*padded_args)
    assert torch.equal(out, ref_pad)
    assert not out.isnan().any()
    bf = torch.full((len(sizes), n, k), float("nan"), dtype=torch.bfloat16, device=DEV)
    k_grouped_fp8_gemm(*args, out=bf)
    assert torch.equal(bf, k_grouped_fp8_gemm(*padded_args, out_dtype=torch.bfloat16))
    return out, args


EDGE = torch.tensor([0, 1, 15, 16, 17, 127, 128, 129, 0, 300], dtype=torch.int64)


@pytest.mark.parametrize(
    "sizes,n,k",
    [
        (EDGE, 256, 384),
        (torch.tensor([1000]), 768, 2048),               # all tokens in one group
        (torch.tensor([0, 0, 513, 0]), 1408, 256),        # empty groups around one
        (make_group_sizes(4096, 32, "paper", 1), 2048, 1024),
        (make_group_sizes(8192, 256, "with_empty", 2), 256, 512),
        (make_group_sizes(16384, 8, "skewed", 3), 4096, 4096),
        (torch.tensor([100, 37]), 96, 48),               # N, K not multiples of 128
        (torch.tensor([15, 16, 17, 1, 0, 31, 33]), 128, 256),  # groups of less than a block, gaps of 95..127
        # (from the aligned-start experiment's tests, now the one kernel's layout)
        (torch.tensor([512, 0, 144, 37]), 256, 384),             # partial last blocks (144 = 128 + 16), an empty group
        (torch.tensor([16, 48, 0, 272, 1000]), 272, 400),         # N and K not multiples of 128, a 16-token group
        (torch.tensor([1000]), 768, 1408),                      # one group, its last block partial
        (torch.tensor([256] * 32), 512, 512),                   # balanced, whole blocks only
        (torch.tensor([0, 0, 0, 5]), 128, 128),                 # only the last group holds tokens
    ],
)
def test_bitexact_vs_padded(sizes, n, k):
    _check(sizes, n, k, seed=int(sizes.sum()) + n)


def test_accuracy_vs_float64():
    sizes = make_group_sizes(6000, 8, "paper", 5)
    out, args = _check(sizes, 1024, 768, seed=3)
    ref = T.k_grouped_ref64(*args)
    for g in range(len(sizes)):
        if sizes[g] > 0:
            d = T.diff(out[g].double(), ref[g])
            assert d < 1e-3, (g, d)


def test_accumulate_equals_c_plus_result_and_skips_empty_groups():
    sizes = torch.tensor([300, 0, 129, 1])
    x, dy = _operands(sizes, 256, 256, 7)
    args = _quantized(x, dy, sizes)
    result = k_grouped_fp8_gemm(*args)
    c = torch.randn(4, 256, 256, device=DEV)
    d = c.clone()
    k_grouped_fp8_gemm(*args, out=d, accumulate=True)
    assert torch.equal(d, c + result)
    assert torch.equal(d[1], c[1])


@pytest.mark.parametrize("sizes,n,k", [
    (torch.tensor([200, 57, 0, 512]), 512, 256),
    (torch.tensor([100, 37]), 96, 48),                   # one partial tile: TMA clips rows and columns
    (torch.tensor([300, 0, 129]), 1040, 784),             # partial last tiles in N and K
    (make_group_sizes(8192, 32, "paper", 4), 1024, 512),  # many tiles per CTA: the staging buffers rotate
])
@pytest.mark.parametrize("offset", [0, 2])  # elements: a 16-byte aligned out takes TMA stores, else register stores
def test_bf16_output_is_rounded_fp32(sizes, n, k, offset):
    x, dy = _operands(sizes, n, k, 8)
    args = _quantized(x, dy, sizes)
    g = len(sizes)
    storage = torch.empty(g * n * k + 8, dtype=torch.bfloat16, device=DEV)
    out = storage[offset:][: g * n * k].view(g, n, k)
    storage.fill_(float("nan"))  # poisoned: every element must be written, nothing outside out
    k_grouped_fp8_gemm(*args, out=out, out_dtype=torch.bfloat16)
    assert torch.equal(out, k_grouped_fp8_gemm(*args).bfloat16())
    outside = torch.cat([storage[:offset], storage[offset + g * n * k:]])
    assert outside.isnan().all()


@pytest.mark.parametrize("sizes,n,k", [
    (torch.tensor([300, 0, 129, 1]), 256, 256),
    (torch.tensor([100, 37]), 96, 48),                   # one partial tile: TMA clips rows and columns
    (torch.tensor([300, 0, 129]), 1040, 784),             # partial last tiles in N and K (K % 32 != 0)
    (make_group_sizes(8192, 32, "paper", 4), 1024, 512),  # many tiles per CTA: the staging buffers rotate
    (torch.tensor([5000]), 256, 384),                     # one long group: many blocks per tile
])
def test_fp32_tma_and_register_epilogues_agree(sizes, n, k):
    """A 16-byte aligned FP32 out takes the shared-memory + TMA epilogue (a TMA reduce-add when accumulating);
    an out 8 bytes past that takes the register path. Both compute c + acc, one FP32 add per element: the same bits,
    with and without accumulate, and nothing written outside out."""
    x, dy = _operands(sizes, n, k, 11)
    args = _quantized(x, dy, sizes)
    g = len(sizes)
    c = torch.randn(g, n, k, device=DEV)
    results = []
    for offset in (0, 2):  # floats
        storage = torch.full((g * n * k + 8,), float("nan"), device=DEV)
        out = storage[offset:][: g * n * k].view(g, n, k)
        k_grouped_fp8_gemm(*args, out=out)
        plain = out.clone()
        out.copy_(c)
        k_grouped_fp8_gemm(*args, out=out, accumulate=True)
        outside = torch.cat([storage[:offset], storage[offset + g * n * k:]])
        assert outside.isnan().all()
        results.append((plain, out.clone()))
    (plain_tma, acc_tma), (plain_reg, acc_reg) = results
    assert torch.equal(plain_tma, plain_reg)
    assert torch.equal(acc_tma, acc_reg)
    assert torch.equal(acc_tma, c + plain_tma)
    empty = (sizes == 0).nonzero().flatten().tolist()
    for e in empty:  # an empty group leaves C unchanged when accumulating
        assert torch.equal(acc_tma[e], c[e])


def test_accumulate_keeps_subnormal_c():
    """D = C + acc is one IEEE FP32 add (docs/layouts.md), subnormals kept: C subnormal (|C| < 2^-126) and acc
    exactly 0 (dY rows of zeros) gives C back, bit for bit, on the TMA reduce-add epilogue (aligned out) as on the
    register one (an out 8 bytes off), as in the reference; both paths give the same bits everywhere, C + their
    own result where acc is not 0. (A reduce-add that flushed subnormals would give +0 in the zero rows.)"""
    sizes = torch.tensor([130, 0, 200])
    n, k = 256, 128
    x, dy = _operands(sizes, n, k, 21)
    dy[:, : n // 2] = 0  # rows 0..127 of every dW_g are exactly 0
    args = _quantized(x, dy, sizes)
    g = len(sizes)
    gen = torch.Generator(device=DEV).manual_seed(5)
    c = torch.randn(g, n, k, generator=gen, device=DEV) * 2.0 ** -130  # subnormal FP32 (and some normal tails)
    assert (c[:, : n // 2].abs() < 2.0 ** -126).float().mean() > 0.9
    want = R.k_grouped_fp8_gemm(*(a.cpu() for a in args[:4]), sizes, out=c.cpu().clone(), accumulate=True)
    plain = k_grouped_fp8_gemm(*args)
    results = []
    for offset in (0, 2):  # floats: the TMA reduce-add, then the register epilogue
        storage = torch.zeros(g * n * k + 8, device=DEV)
        out = storage[offset:][: g * n * k].view(g, n, k)
        out.copy_(c)
        k_grouped_fp8_gemm(*args, out=out, accumulate=True)
        top = out[:, : n // 2]
        assert torch.equal(top, c[:, : n // 2]), f"offset {offset}: {int((top != c[:, : n // 2]).sum())} differ"
        assert torch.equal(top.cpu(), want[:, : n // 2]), f"offset {offset}: differs from the reference"
        results.append(out.clone())
    assert torch.equal(results[0], results[1])
    nonempty = sizes != 0
    assert torch.equal(results[0][nonempty], (c + plain)[nonempty]) and torch.equal(results[0][1], c[1])


def test_repeatable_and_offsets_equal_sizes():
    sizes = make_group_sizes(5000, 16, "paper", 9)
    x, dy = _operands(sizes, 512, 512, 9)
    dyt, dys, xt, xs, g = _quantized(x, dy, sizes)
    first = k_grouped_fp8_gemm(dyt, dys, xt, xs, g)
    offsets = torch.zeros(17, dtype=torch.int32, device=DEV)
    offsets[1:] = torch.cumsum(g, 0)
    for _ in range(3):
        assert torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, g), first)
    # offsets [G+1]: G from num_groups or from out
    assert torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, offsets, num_groups=16), first)
    out = torch.full_like(first, float("nan"))
    assert torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, offsets, out=out), first)
    assert torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, g.int(), num_groups=16), first)


def _wider(t, pitch):
    """The same [rows, P] bytes in a wider buffer: row pitch `pitch` (a multiple of 16)."""
    buf = torch.full((t.shape[0], pitch), 0x7F, dtype=torch.uint8, device=t.device)  # NaN past P
    buf[:, : t.shape[1]] = t.view(torch.uint8)
    return buf.view(torch.float8_e4m3fn)[:, : t.shape[1]]


@pytest.mark.parametrize("sizes,n,k", [
    (torch.tensor([129, 0, 15, 0, 16, 1, 17, 127, 128, 0, 300, 33]), 256, 384),
    (torch.tensor([1, 1, 1, 1]), 128, 128),
    (make_group_sizes(4096, 32, "with_empty", 6), 512, 256),
])
def test_nothing_past_the_groups_is_read(sizes, n, k):
    """The tail [a_G, P) (zeros from the quantizer) and the bytes past P in a wider row pitch are never multiplied
    into a result: poisoned with NaN, the bits do not change. (The gaps between groups are read: a partial last block
    is loaded whole, and the quantizer's zeros there give exact zero products, docs/design.md §4.)"""
    x, dy = _operands(sizes, n, k, 12)
    dyt, dys, xt, xs, g = _quantized(x, dy, sizes)
    want = k_grouped_fp8_gemm(dyt, dys, xt, xs, g)
    c = torch.randn(want.shape, device=DEV)
    want_acc = k_grouped_fp8_gemm(dyt, dys, xt, xs, g, out=c.clone(), accumulate=True)
    a_last = sum(-(-m // 128) * 128 for m in sizes.tolist())
    gaps = torch.zeros(dyt.shape[1], dtype=torch.bool, device=DEV)
    gaps[a_last:] = True
    assert 0 < gaps.sum() < dyt.shape[1]
    poisoned = [t.clone() for t in (dyt, xt)]
    for t in poisoned:
        t.view(torch.uint8)[:, gaps] = 0x7F
    for pitch in (dyt.shape[1], dyt.shape[1] + 64):
        pdy, px = (t if pitch == t.shape[1] else _wider(t, pitch) for t in poisoned)
        assert pdy.stride(0) == pitch
        assert torch.equal(k_grouped_fp8_gemm(pdy, dys, px, xs, g), want)
        assert torch.equal(k_grouped_fp8_gemm(pdy, dys, px, xs, g, out=c.clone(), accumulate=True), want_acc)
        bf = k_grouped_fp8_gemm(pdy, dys, px, xs, g, out_dtype=torch.bfloat16)
        assert torch.equal(bf, want.bfloat16())


def test_malformed_device_sizes_stay_inside_the_operands():
    """Device sizes are not read on the host: sizes that overrun P (or are negative) are clamped by the kernel
    (a_g to P, negative sizes to 0), so the call completes without a fault; the values are undefined."""
    sizes = torch.tensor([300, 0, 129, 1])
    x, dy = _operands(sizes, 256, 256, 13)
    args = _quantized(x, dy, sizes)
    good = k_grouped_fp8_gemm(*args)
    for bad in ([4000, 0, 129, 1], [300, -50, 129, 5000], [-1, -1, -1, -1]):
        out = torch.empty(4, 256, 256, device=DEV)
        k_grouped_fp8_gemm(*args[:4], torch.tensor(bad, device=DEV), out=out)
        torch.cuda.synchronize()
    assert torch.equal(k_grouped_fp8_gemm(*args), good)
    # a size within 127 of INT_MAX rounds up to 128 in 64 bits (it wrapped negative in int): clamped to P like any
    # overrun, so group 0 owns every column, as with the size P itself (the scales are per 128-column block either way)
    p_cols = args[0].shape[1]
    whole = k_grouped_fp8_gemm(*args[:4], torch.tensor([p_cols, 0, 0, 0], device=DEV))
    for huge in (2**31 - 100, 2**31 - 1):
        out = torch.full((4, 256, 256), float("nan"), device=DEV)
        k_grouped_fp8_gemm(*args[:4], torch.tensor([huge, 0, 0, 0], device=DEV), out=out)
        assert torch.equal(out, whole), huge


def test_cuda_graph_replay_with_new_sizes_and_no_sync():
    m, n, k, G = 4096, 512, 384, 16
    gen = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=DEV).bfloat16()
    g = make_group_sizes(m, G, "paper", 1).to(DEV)
    out = torch.empty(G, n, k, device=DEV)
    static = list(_quantized(x, dy, g.cpu()))
    k_grouped_fp8_gemm(*static, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k_grouped_fp8_gemm(*static, out=out)
    for seed, dist in [(2, "skewed"), (3, "with_empty")]:
        sizes = make_group_sizes(m, G, dist, seed)
        fresh = _quantized(x, dy, sizes)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, k_grouped_fp8_gemm(*fresh))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        k_grouped_fp8_gemm(*static, out=out)
        k_grouped_fp8_gemm(*static, out=out, accumulate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("fused", [False, True])
def test_no_tokens_from_the_cuda_quantizers(fused):
    """M_total = 0 (an expert-parallel rank that received no token): the quantizers hand back zeros [rows, 128 G]
    and scales [G, rows]; the GEMM zeroes `out`, or leaves C unchanged when accumulating."""
    sizes = torch.zeros(4, dtype=torch.int64, device=DEV)
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=DEV)
    dy = torch.empty(0, 384, dtype=torch.bfloat16, device=DEV)
    if fused:
        *_, xt, xs = quant.quantize_1x128_and_grouped_128x1(x, sizes, num_groups=4)
        *_, dyt, dys = quant.quantize_1x128_and_grouped_128x1(dy, sizes, num_groups=4)
    else:
        xt, xs = quant.quantize_grouped_128x1(x, sizes, num_groups=4)
        dyt, dys = quant.quantize_grouped_128x1(dy, sizes, num_groups=4)
    assert xt.shape == (256, 512) and dyt.shape == (384, 512) and xt.is_contiguous() and dyt.is_contiguous()
    assert not xt.view(torch.uint8).any() and not dyt.view(torch.uint8).any()
    assert xs.shape == (4, 256) and dys.shape == (4, 384) and not xs.any() and not dys.any()
    out = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=torch.full((4, 384, 256), float("nan"), device=DEV))
    assert torch.equal(out, torch.zeros_like(out))
    c = torch.randn(4, 384, 256, device=DEV)
    d = c.clone()
    k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=d, accumulate=True)
    assert torch.equal(d, c)
    bf = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and not bf.any()
