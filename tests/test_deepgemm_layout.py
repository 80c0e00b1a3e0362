"""benchmarks/deepgemm_baseline.py on the CPU: our FP8 operands converted into DeepGEMM 2.6.1's (deepseek-ai/DeepGEMM)
SM90 grouped layouts hold the same numbers. Built from the reference quantizers; the product DeepGEMM computes is
emulated in float64 over its own layout (its indexing: m_indices, ks, flat K-major blocks, MN-major scales) and
compared with the same product over ours. DeepGEMM itself is not needed (tests/test_deepgemm_gpu.py runs it)."""
import os
import sys

import pytest
import torch

from megatron_tma import quant
from megatron_tma import reference as R
from megatron_tma.groups import aligned_token_offsets
from megatron_tma.padding import pad_rows_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import deepgemm_baseline as dgb  # noqa: E402
from _fake_timer import recording_timer  # noqa: E402

SIZES = [[0, 1, 127, 128, 129], [129, 0, 128, 1, 0, 127, 0], [1], [0], [300], [0, 0, 256, 5]]


def _ids(sizes):
    return "-".join(map(str, sizes))


def _u8(t):
    return t.view(torch.uint8)


def _f64(q):
    return q.to(torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# M-grouped
# ---------------------------------------------------------------------------------------------------------------
def test_m_indices_marks_each_groups_rows_and_padding():
    sizes = [0, 1, 127, 128, 129]
    idx = dgb.m_indices(sizes, 896).tolist()
    expected = [1] + [-1] * 127 + [2] * 127 + [-1] + [3] * 128 + [4] * 129 + [-1] * 127 + [-1] * 256
    assert idx == expected
    assert dgb.m_indices(sizes, 640).tolist() == expected[:640]
    assert dgb.valid_rows(sizes).tolist() == [0] + list(range(128, 255)) + list(range(256, 384)) + list(range(384, 513))
    with pytest.raises(ValueError, match="need 640"):
        dgb.m_indices(sizes, 512)


def _dg_m_grouped_f64(a, sfa, b, sfb, idx):
    """What m_grouped_fp8_gemm_nt_contiguous computes, in float64 over its layout: row r of group idx[r] is
    sum_kb (a[r, kb] sfa[r, kb]) . (b[g, :, kb] sfb[g, n // 128, kb]); rows with idx -1 are not computed (NaN)."""
    rows, k = a.shape
    g_count, n, _ = b.shape
    a64 = _f64(a).view(rows, k // 128, 128) * sfa.double()[:, :, None]
    b64 = _f64(b).view(g_count, n, k // 128, 128) * sfb.double().repeat_interleave(128, 1)[:, :n, :, None]
    out = torch.full((rows, n), float("nan"), dtype=torch.float64)
    for g in range(g_count):
        r = (idx == g).nonzero().flatten()
        out[r] = a64[r].reshape(len(r), k) @ b64[g].reshape(n, k).t()
    return out


@pytest.mark.parametrize("sizes", SIZES, ids=_ids)
def test_m_grouped_operands_from_the_padded_path(sizes, gen):
    m, g_count, n, k = sum(sizes), len(sizes), 256, 384
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(g_count, n, k, generator=gen) * 0.05).bfloat16()
    aq, a_s = quant.quantize_1x128(x)
    wq, ws, _, _ = quant.quantize_128x128(w)
    a_pad, s_pad, offs = pad_rows_fp8(aq, a_s, torch.tensor(sizes), 128, num_groups=g_count)
    (a, sfa), (b, sfb), idx = dgb.m_grouped_args(a_pad, s_pad, wq, ws, sizes)
    assert a.data_ptr() == a_pad.data_ptr() and sfa.data_ptr() == s_pad.data_ptr() and b.data_ptr() == wq.data_ptr()
    assert idx.dtype == torch.int32 and idx.shape == (a_pad.shape[0],)
    # DeepGEMM's SM90 FP32 scale layout: M-contiguous, column stride TMA-aligned (else it copies in every call)
    if a.shape[0]:
        assert sfa.stride(0) == 1 and sfa.stride(1) % 4 == 0 and sfa.stride(1) >= a.shape[0]
    assert tuple(sfb.shape) == (g_count, n // 128, k // 128)
    assert int(offs[-1]) == sum(dgb.round_up(s) for s in sizes) and int((idx >= 0).sum()) == m
    assert not bool(_u8(a)[idx < 0].any())  # padding rows are zero data
    rows = dgb.valid_rows(sizes)
    assert torch.equal(idx[rows], torch.repeat_interleave(torch.arange(g_count, dtype=torch.int32),
                                                          torch.tensor(sizes)))
    assert torch.equal(_u8(a[rows]), _u8(aq)) and torch.equal(sfa[rows], a_s)
    x64 = R.dequantize_1x128(aq, a_s, torch.float64)
    ours = torch.cat([part @ R.dequantize_128x128(wq[g], ws[g], torch.float64).t()
                      for g, part in enumerate(torch.split(x64, sizes))])
    dg = _dg_m_grouped_f64(a, sfa, b, sfb, idx)
    assert torch.allclose(dg[rows], ours, rtol=1e-12, atol=1e-12)
    assert bool(dg[idx < 0].isnan().all())  # nothing else was computed


def test_m_grouped_args_refuse_scales_that_deepgemm_would_copy():
    a = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    w = torch.zeros(1, 128, 256, dtype=torch.float8_e4m3fn)
    ws = torch.ones(1, 1, 2)
    with pytest.raises(ValueError, match="M-contiguous"):
        dgb.m_grouped_args(a, torch.ones(256, 2), w, ws, [200])  # row-major scales
    with pytest.raises(ValueError, match="multiple of 128"):
        dgb.m_grouped_args(a[:200], torch.ones(2, 200).t(), w, ws, [200])


# ---------------------------------------------------------------------------------------------------------------
# K-grouped
# ---------------------------------------------------------------------------------------------------------------
def _dg_k_grouped_f64(a, sfa, b, sfb, ks, n, k):
    """What k_grouped_fp8_gemm_nt_contiguous adds to d, in float64 over its layout: group g's K-major blocks
    a_g [n, k_g], b_g [k, k_g] at the running flat offsets, 128-token block j scaled by sfa[:, B_g + j]."""
    out, off, blk = [], 0, 0
    for kg in ks:
        ag = _f64(a[off * n:(off + kg) * n]).view(n, kg)
        bg = _f64(b[off * k:(off + kg) * k]).view(k, kg)
        acc = torch.zeros(n, k, dtype=torch.float64)
        for j in range(kg // 128):
            cols = slice(128 * j, 128 * (j + 1))
            acc += ((ag[:, cols] * sfa[:, blk + j].double()[:, None])
                    @ (bg[:, cols] * sfb[:, blk + j].double()[:, None]).t())
        out.append(acc)
        off, blk = off + kg, blk + kg // 128
    return torch.stack(out)


def _ours_k_grouped_f64(qt_dy, s_dy, qt_x, s_x, sizes):
    """The same product over our layout: group g's tokens at columns a_g + t, block j's scales in row B_g + j."""
    a = aligned_token_offsets(torch.tensor(sizes)).tolist()
    out, blk = [], 0
    for g, m in enumerate(sizes):
        acc = torch.zeros(qt_dy.shape[0], qt_x.shape[0], dtype=torch.float64)
        for j in range(-(-m // 128)):
            cols = slice(a[g] + 128 * j, a[g] + min(128 * (j + 1), m))
            acc += (_f64(qt_dy[:, cols]) * s_dy[blk + j].double()[:, None]) @ (
                _f64(qt_x[:, cols]) * s_x[blk + j].double()[:, None]).t()
        out.append(acc)
        blk += -(-m // 128)
    return torch.stack(out)


def _wgrad_operands(sizes, n, k, gen):
    m = sum(sizes)
    x = torch.randn(m, k, generator=gen).bfloat16()
    dy = (torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen).float())).bfloat16()
    groups = torch.tensor(sizes)
    qt_x, s_x = quant.quantize_grouped_128x1(x, groups)
    qt_dy, s_dy = quant.quantize_grouped_128x1(dy, groups)
    return qt_dy, s_dy, qt_x, s_x


@pytest.mark.parametrize("sizes", SIZES, ids=_ids)
def test_k_grouped_operands_hold_our_numbers(sizes, gen):
    n, k = 64, 48
    qt_dy, s_dy, qt_x, s_x = _wgrad_operands(sizes, n, k, gen)
    args = dgb.k_grouped_args(qt_dy, s_dy, qt_x, s_x, sizes)
    ks = [dgb.round_up(s) for s in sizes]
    assert args["ks"] == ks and args["ks_tensor"].dtype == torch.int32 and args["ks_tensor"].tolist() == ks
    (a, sfa), (b, sfb) = args["a"], args["b"]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.dim() == b.dim() == 1 and a.is_contiguous()
    assert a.numel() == n * sum(ks) and b.numel() == k * sum(ks)
    # MN-major with a TMA-aligned column stride: DeepGEMM uses it as it is (no copy in the timed call)
    assert tuple(sfa.shape) == (n, sum(ks) // 128) and tuple(sfb.shape) == (k, sum(ks) // 128)
    if sum(ks):
        assert sfa.stride() == (1, n) and sfb.stride() == (1, k)
    starts = aligned_token_offsets(torch.tensor(sizes)).tolist()
    off = 0
    for g, (m, kg) in enumerate(zip(sizes, ks)):
        block = _u8(a[off * n:(off + kg) * n]).view(n, kg)
        assert torch.equal(block[:, :m], _u8(qt_dy)[:, starts[g]:starts[g] + m])
        assert not bool(block[:, m:].any())  # the gap to k_g is zero tokens
        off += kg
    dg = _dg_k_grouped_f64(a, sfa, b, sfb, ks, n, k)
    ours = _ours_k_grouped_f64(qt_dy, s_dy, qt_x, s_x, sizes)
    assert torch.allclose(dg, ours, rtol=1e-12, atol=1e-12)
    for g, m in enumerate(sizes):
        if m == 0:
            assert not bool(dg[g].any())
    # and both are the GEMM our reference computes (FP32 accumulation: close, not equal)
    ref = R.k_grouped_fp8_gemm(qt_dy, s_dy, qt_x, s_x, torch.tensor(sizes))
    assert torch.allclose(dg.float(), ref, rtol=1e-4, atol=1e-3 * max(1.0, float(ref.abs().max())))


def test_k_grouped_operand_zero_fills_past_each_group_at_any_column_alignment(gen):
    """A 16-aligned layout (a_g = sum round_up(M_h, 16)) with non-zero bytes in the gaps gives the same DeepGEMM
    operand as our 128-aligned one: only [a_g, a_g + M_g) is read."""
    sizes = [0, 1, 127, 128, 129, 17]
    qt, s, _, _ = _wgrad_operands(sizes, 32, 16, gen)
    a128 = aligned_token_offsets(torch.tensor(sizes)).tolist()
    a16 = [0]
    for m in sizes:
        a16.append(a16[-1] + -(-m // 16) * 16)
    qt16 = torch.full((qt.shape[0], a16[-1] + 16), 0x38, dtype=torch.uint8)  # 1.0 in every gap column
    for g, m in enumerate(sizes):
        qt16[:, a16[g]:a16[g] + m] = _u8(qt)[:, a128[g]:a128[g] + m]
    want, want_sf = dgb.k_grouped_operand(qt, s, sizes)
    got, got_sf = dgb.k_grouped_operand(qt16.view(torch.float8_e4m3fn), s, sizes, starts=a16)
    assert torch.equal(_u8(got), _u8(want)) and torch.equal(got_sf, want_sf)
    # the test has teeth: group 1 (one token) copied as a whole k_g = 128 columns would carry the 1.0s
    assert bool((qt16[:, a16[1] + 1:a16[1] + 128] != 0).any())


def test_k_grouped_operand_copies_scales_only_when_their_stride_is_not_tma_aligned():
    sizes = [130, 0, 5]
    r, mb = 6, 300 // 128 + 3
    qt = torch.randint(0, 0x70, (r, 640), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.rand(mb, r)
    _, sf = dgb.k_grouped_operand(qt, s, sizes)
    assert tuple(sf.shape) == (r, 3) and sf.stride() == (1, 8) and torch.equal(sf, s[:3].t())
    s4 = torch.rand(mb, 8)
    _, sf4 = dgb.k_grouped_operand(torch.zeros(8, 640, dtype=torch.float8_e4m3fn), s4, sizes)
    assert sf4.data_ptr() == s4.data_ptr() and sf4.stride() == (1, 8)


def test_k_grouped_operand_refuses_what_does_not_fit():
    qt, s = torch.zeros(8, 256, dtype=torch.float8_e4m3fn), torch.ones(3, 8)
    with pytest.raises(ValueError, match="outside qt"):
        dgb.k_grouped_operand(qt, s, [100, 100], starts=[0, 200])
    with pytest.raises(ValueError, match="scales must be"):
        dgb.k_grouped_operand(qt, s[:1], [100, 100], starts=[0, 128])
    with pytest.raises(ValueError, match=">= 0"):
        dgb.k_grouped_ks([3, -1])


# ---------------------------------------------------------------------------------------------------------------
def test_load_says_why_without_deep_gemm(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` raises ImportError
    dg, why = dgb.load()
    assert dg is None and why.startswith(("ImportError", "ModuleNotFoundError"))
    fake = type(sys)("deep_gemm")
    fake.__version__ = "2.6.1"
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    dg, why = dgb.load()
    assert dg is fake and why is None and dgb.version(dg) == "2.6.1"


# ---------------------------------------------------------------------------------------------------------------
# bench_k_grouped's DeepGEMM column, end to end on the CPU with a stand-in for deep_gemm
# ---------------------------------------------------------------------------------------------------------------
class _StandInDeepGEMM:
    """k_grouped_fp8_gemm_nt_contiguous read as DeepGEMM's SM90 host code reads its arguments (ks multiples of 128,
    c is d, flat K-major blocks, MN-major scales), computed by putting the blocks back at 128-aligned columns and
    running our reference GEMM. `corrupt` swaps two scale columns: the benchmark must then report different bits."""
    __version__ = "stand-in"

    def __init__(self, corrupt=False):
        self.corrupt, self.calls = corrupt, 0

    def k_grouped_fp8_gemm_nt_contiguous(self, a, b, d, ks, ks_tensor, c):
        from megatron_tma.gemm import k_grouped_fp8_gemm
        from megatron_tma.groups import wgrad_pitch
        self.calls += 1
        assert c is d and d.dtype == torch.float32 and d.is_contiguous()
        assert isinstance(ks, list) and ks_tensor.dtype == torch.int32 and ks_tensor.tolist() == ks
        assert all(k % 128 == 0 for k in ks) and len(ks) == d.shape[0]
        g_count, total = len(ks), sum(ks)

        def ours(flat, sf, r):
            assert flat.dim() == 1 and flat.numel() == r * total and tuple(sf.shape) == (r, total // 128)
            assert sf.stride(0) == 1 and sf.stride(1) == dgb.round_up(r, 4)
            qt = torch.zeros(r, wgrad_pitch(total, g_count), dtype=torch.uint8)
            col = 0
            for kg in ks:
                qt[:, col:col + kg] = _u8(flat)[col * r:(col + kg) * r].view(r, kg)
                col += kg
            s = torch.zeros(total // 128 + g_count, r)
            s[:total // 128] = sf.t()
            if self.corrupt and total >= 256:
                s[[0, 1]] = s[[1, 0]]
            return qt.view(torch.float8_e4m3fn), s

        (qa, sa), (qb, sb) = ours(*a, d.shape[1]), ours(*b, d.shape[2])
        k_grouped_fp8_gemm(qa, sa, qb, sb, torch.tensor(ks), out=d, accumulate=True)


def _load_bench_k_grouped():
    import bench_k_grouped
    return bench_k_grouped


@pytest.mark.parametrize("corrupt", [False, True])
def test_bench_k_grouped_deepgemm_column_dry_run(monkeypatch, corrupt):
    bkg = _load_bench_k_grouped()
    timed = {}

    monkeypatch.setattr(bkg.common, "bench_interleaved", recording_timer(timed))
    cfg = ((5, 700, 32, 48), "with_empty")
    names = bkg.timing_plan([cfg], deepgemm=True)[0]
    assert "deepgemm@fp32_acc" in names and "deepgemm@bf16" not in names
    assert "deepgemm@fp32_acc" not in bkg.timing_plan([cfg])[0]
    assert bkg.timed_calls([cfg], 25, deepgemm=True) == bkg.timed_calls([cfg], 25) + 25
    dg = _StandInDeepGEMM(corrupt)
    bf, fa = bkg.run_config(5, 700, 32, 48, "with_empty", 1, 3, {"copy_tbps": 4.0, "dense_fp8_tflops": 1000.0},
                            names, {}, dev="cpu", dg=dg)
    assert dg.calls == 2 and timed["deepgemm@fp32_acc"] == 1  # one untimed call for the bits, then the timer's
    assert fa["empty_groups"] > 0 and "deepgemm_error" not in fa
    assert fa["deepgemm_bitexact"] is (not corrupt) and fa["bitexact"] is True
    assert fa["deepgemm_ms"] > 0 and fa["speedup_vs_deepgemm"] == round(fa["deepgemm_ms"] / fa["ours_ms"], 4)
    assert not any(k.startswith(("deepgemm", "speedup_vs_deepgemm")) for k in bf)
    s = bkg.summarize([bf, fa])
    assert s["all_deepgemm_bitexact"] is (not corrupt) and s["geomean_vs_deepgemm"] == fa["speedup_vs_deepgemm"]
    assert bkg.summarize([bf])["all_deepgemm_bitexact"] is None


def test_bench_k_grouped_records_a_deepgemm_that_fails(monkeypatch):
    bkg = _load_bench_k_grouped()

    class Broken:
        def k_grouped_fp8_gemm_nt_contiguous(self, *args):
            raise RuntimeError("Assertion error (csrc/apis/gemm.hpp:364): sum_mk == sum_k * m\nmore")

    monkeypatch.setattr(bkg.common, "bench_interleaved", lambda fns, iters=25: {n: 1.0 for n in fns})
    names = bkg.timing_plan([((2, 300, 32, 32), "paper")], deepgemm=True)[0]
    _, fa = bkg.run_config(2, 300, 32, 32, "paper", 1, 3, {"copy_tbps": 4.0, "dense_fp8_tflops": 1000.0}, names, {},
                           dev="cpu", dg=Broken())
    assert fa["deepgemm_error"].startswith("RuntimeError: Assertion error") and "more" not in fa["deepgemm_error"]
    assert not any(k in fa for k in ("deepgemm_ms", "deepgemm_bitexact", "speedup_vs_deepgemm"))


def test_result_fields():
    assert dgb.result_fields(None, "ModuleNotFoundError: No module named 'deep_gemm'") == {
        "deepgemm_present": False, "deepgemm_version": None,
        "deepgemm_absent_reason": "ModuleNotFoundError: No module named 'deep_gemm'"}
    assert dgb.result_fields(_StandInDeepGEMM(), None) == {"deepgemm_present": True, "deepgemm_version": "stand-in"}


def test_check_alignment_refuses_a_changed_block_m():
    class Fake:
        value = 128

        def get_mk_alignment_for_contiguous_layout(self):
            return self.value

    fake = Fake()
    dgb.check_alignment(fake)
    fake.value = 64
    with pytest.raises(RuntimeError, match="is 64"):
        dgb.check_alignment(fake)
