"""M-grouped FP8 GEMM on the H200: bit-exact against the padded layout, accurate against float64, writes
nothing outside its groups, graph-capturable, no host sync. Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma.gemm import m_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"


def _activations(m, k, gen):
    # rows of very different magnitudes, so per-row scales matter
    x = torch.randn(m, k, generator=gen, device=DEV)
    x *= torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen, device=DEV).float())
    return x.bfloat16()


def _weights(g, n, k, gen):
    return (torch.randn(g, n, k, generator=gen, device=DEV) * 0.05).bfloat16()


def _pad_rows(x, sizes, align):
    """Zero rows appended to each group up to a multiple of `align` (host bookkeeping: test oracle only)."""
    chunks, padded = [], []
    for part, s in zip(torch.split(x, sizes.tolist()), sizes.tolist()):
        p = -(-s // align) * align
        chunks.append(torch.cat([part, part.new_zeros(p - s, x.shape[1])]))
        padded.append(p)
    return torch.cat(chunks), torch.tensor(padded, dtype=torch.int64)


def _unpad_rows(y, sizes, padded):
    out, start = [], 0
    for s, p in zip(sizes.tolist(), padded.tolist()):
        out.append(y[start : start + s])
        start += p
    return torch.cat(out)


def _run(m, n, k, g, dist, seed, dgrad=False, align=128):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    sizes = make_group_sizes(m, g, dist, seed)
    w = _weights(g, n, k, gen)
    wq, ws, wtq, wts = R.quantize_128x128(w)
    if dgrad:  # dX = dY . W: contraction over N, output K
        b, bs, kk, nn = wtq, wts, n, k
    else:
        b, bs, kk, nn = wq, ws, k, n
    x = _activations(m, kk, gen)
    aq, a_s = R.quantize_1x128(x)
    groups = sizes.to(DEV)
    out = torch.full((m, nn), float("nan"), dtype=torch.bfloat16, device=DEV)  # poisoned
    m_grouped_fp8_gemm(aq, a_s, b, bs, groups, out=out)
    # oracle 1: the padded layout through the same kernel, valid rows only
    xp, padded = _pad_rows(x, sizes, align)
    pq, p_s = R.quantize_1x128(xp)
    yp = m_grouped_fp8_gemm(pq, p_s, b, bs, padded.to(DEV))
    ref_pad = _unpad_rows(yp, sizes, padded) if m else yp[:0]
    return out, ref_pad, (aq, a_s, b, bs, groups)


SHAPES = [
    # (M, N, K, G, dist)
    (0, 768, 128, 1, "balanced"),
    (1, 768, 128, 1, "balanced"),
    (64, 1408, 2048, 2, "paper"),
    (127, 2048, 128, 8, "paper"),
    (128, 768, 2048, 1, "one_group"),
    (129, 4096, 128, 2, "with_empty"),
    (1000, 1408, 2048, 32, "paper"),
    (1000, 7168, 128, 128, "skewed"),
    (1000, 768, 2048, 256, "with_empty"),
    (4096, 2048, 7168, 8, "skewed"),
    (65536, 4096, 2048, 32, "paper"),
    (65536, 7168, 7168, 8, "paper"),
]


@pytest.mark.parametrize("m,n,k,g,dist", SHAPES)
def test_forward_bitexact_vs_padded(m, n, k, g, dist):
    out, ref_pad, _ = _run(m, n, k, g, dist, seed=m + n + k + g)
    assert torch.equal(out, ref_pad)
    assert not out.isnan().any()  # every row was written


@pytest.mark.parametrize("m,n,k,g,dist", [(1000, 2048, 768, 8, "paper"), (129, 7168, 2048, 2, "with_empty"),
                                          (4096, 4096, 1408, 32, "skewed")])
def test_dgrad_bitexact_vs_padded(m, n, k, g, dist):
    # dgrad contracts over the forward N: n must be a multiple of 128; output has k columns
    out, ref_pad, _ = _run(m, n, k, g, dist, seed=7 * m + g, dgrad=True)
    assert torch.equal(out, ref_pad)
    assert not out.isnan().any()


@pytest.mark.parametrize("m,n,k,g,dist", [(1000, 1408, 2048, 32, "paper"), (4096, 2048, 7168, 8, "skewed"),
                                          (129, 768, 128, 2, "with_empty")])
def test_accuracy_vs_float64(m, n, k, g, dist):
    out, _, (aq, a_s, b, bs, groups) = _run(m, n, k, g, dist, seed=1234 + m)
    ref = T.m_grouped_ref64(aq, a_s, b, bs, groups)
    d = T.diff(out.double(), ref)
    assert d < 1e-3, d


def test_sizes_as_offsets_and_int32_agree():
    m, n, k, g = 1000, 768, 256, 8
    out, _, (aq, a_s, b, bs, groups) = _run(m, n, k, g, "paper", seed=5)
    offsets = torch.zeros(g + 1, dtype=torch.int32, device=DEV)
    offsets[1:] = torch.cumsum(groups, 0)
    assert torch.equal(m_grouped_fp8_gemm(aq, a_s, b, bs, offsets), out)
    assert torch.equal(m_grouped_fp8_gemm(aq, a_s, b, bs, groups.int()), out)


@pytest.mark.parametrize("n", [1408, 2048])  # an odd and an even number of 128-wide N blocks
def test_writes_nothing_outside_out(n):
    m, k, g = 777, 512, 16
    _, ref_pad, (aq, a_s, b, bs, groups) = _run(m, n, k, g, "with_empty", seed=11)
    sentinel = -12345.0
    big = torch.full((m + 96, n + 64), sentinel, dtype=torch.bfloat16, device=DEV)
    view = big[40 : 40 + m, 32 : 32 + n]  # row pitch n + 64, 64-byte column offset
    m_grouped_fp8_gemm(aq, a_s, b, bs, groups, out=view)
    assert torch.equal(view, ref_pad)
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[40 : 40 + m, 32 : 32 + n] = False
    assert (big[mask] == sentinel).all()


@pytest.mark.parametrize("n", [1408, 2048])
def test_cuda_graph_replay_with_new_sizes(n):
    m, k, g = 2048, 1024, 16
    gen = torch.Generator(device=DEV).manual_seed(3)
    aq, a_s = R.quantize_1x128(_activations(m, k, gen))
    b, bs, _, _ = R.quantize_128x128(_weights(g, n, k, gen))
    groups = make_group_sizes(m, g, "paper", 1).to(DEV)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    m_grouped_fp8_gemm(aq, a_s, b, bs, groups, out=out)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m_grouped_fp8_gemm(aq, a_s, b, bs, groups, out=out)
    for seed, dist in [(2, "skewed"), (3, "with_empty"), (4, "one_group")]:
        groups.copy_(make_group_sizes(m, g, dist, seed).to(DEV))
        out.fill_(float("nan"))
        graph.replay()
        expect = m_grouped_fp8_gemm(aq, a_s, b, bs, groups)
        assert torch.equal(out, expect)


def test_no_host_sync():
    m, n, k, g = 1000, 768, 256, 8
    _, _, (aq, a_s, b, bs, groups) = _run(m, n, k, g, "paper", seed=9)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m_grouped_fp8_gemm(aq, a_s, b, bs, groups, out=out)
        m_grouped_fp8_gemm(aq, a_s, b, bs, groups)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_repeatable():
    out1, _, args = _run(4096, 2048, 1024, 8, "paper", seed=21)
    for _ in range(3):
        assert torch.equal(m_grouped_fp8_gemm(*args), out1)


def test_op_rejects_bad_geometry():
    m, n, k, g = 256, 768, 256, 2
    _, _, (aq, a_s, b, bs, groups) = _run(m, n, k, g, "balanced", seed=1)
    with pytest.raises(ValueError, match="groups must hold"):
        torch.ops.megatron_tma.m_grouped_fp8_gemm_out(aq, a_s, b, bs, groups[:1], torch.empty(m, n, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(TypeError, match="out must be bfloat16"):
        torch.ops.megatron_tma.m_grouped_fp8_gemm_out(aq, a_s, b, bs, groups, torch.empty(m, n, device=DEV))


def test_default_tile_reported_by_m_grouped_tile():
    """The tile the launcher picks (scheduler/m_grouped_tile_choice.h, tested in full on the CPU) is what
    m_grouped_tile reports, including the fallback where a wide tile's shared memory does not fit G's offsets."""
    from megatron_tma.gemm import m_grouped_tile

    assert m_grouped_tile(65536, 4096, 8) == (192, 128)    # large groups
    assert m_grouped_tile(16384, 3072, 32) == (128, 192)   # groups of 512 rows
    assert m_grouped_tile(256, 2048, 8) == (128, 128)      # less than one round of tiles
    assert m_grouped_tile(65536, 4096, 8, block_m=128) == (128, 128)
    assert m_grouped_tile(1024, 256, 2000, block_m=128, block_n=192) == (128, 128)  # 2000 offsets: no room
    with pytest.raises(ValueError, match="no such tile"):
        m_grouped_tile(1024, 256, 8, block_n=64)


@pytest.mark.parametrize("m,n,k,g,dist", [(3000, 1408, 1024, 8, "paper"), (777, 768, 2048, 3, "with_empty"),
                                          (20000, 4096, 1024, 16, "skewed"), (129, 256, 128, 1, "one_group"),
                                          (1000, 784, 256, 4, "paper"), (5000, 7168, 512, 8, "skewed"),
                                          (50, 6144, 128, 1, "one_group"), (4000, 3072, 384, 300, "with_empty"),
                                          (130, 256, 128, 1, "one_group"), (3000, 768, 256, 2000, "with_empty")])
def test_tile_shapes_agree_bit_for_bit(m, n, k, g, dist):
    """Every tile shape computes each element identically: the default 128 x 128 (two-fragment pipeline), 192 x 128
    (three math warpgroups, serial promotion), 128 x 192 (m64n192 wgmma, tiles straddling two weight-scale
    blocks, odd tiles starting mid-block) and 128 x 256 (two 128-column halves). The serial ones write nothing
    outside the valid rows (a partial last column tile, 64-row slices with no row, many groups; G=2000 makes
    the wide tiles fall back to 128 x 128)."""
    out, _, args = _run(m, n, k, g, dist, seed=m * 3 + n)
    for block_m, block_n in ((192, 128), (128, 128), (128, 256), (128, 192), (0, 0)):
        assert torch.equal(m_grouped_fp8_gemm(*args, block_m=block_m, block_n=block_n), out), (block_m, block_n)
    for block_m, block_n in ((192, 128), (128, 192)):
        buf = torch.full((m + 2, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        m_grouped_fp8_gemm(*args, out=buf[1:m + 1], block_m=block_m, block_n=block_n)
        assert torch.equal(buf[1:m + 1], out), (block_m, block_n)
        assert buf[0].isnan().all() and buf[m + 1].isnan().all(), (block_m, block_n)
