"""The GEMM ops' own checks on the H200 (csrc/binding/*_gemm.cpp) against the wrappers' rules (megatron_tma/gemm.py).

The wrappers hold the argument rules and run them on every call; the ops check the same preconditions again,
because compiled graphs and direct torch.ops calls reach them without any Python. Here every bad input the API
documents is shown (1) to be refused by the op itself, as a TypeError or ValueError, and (2) to raise the wrapper's
own error type and message; and a call with checked `Groups` gives the bits of a call with the raw tensor.
Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext, gemm
from megatron_tma import reference as R
from megatron_tma.groups import check_groups

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"
BF16 = torch.bfloat16


def _m_args(m=200, n=256, k=256, g=3, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    w = (torch.randn(g, n, k, generator=gen, device=DEV) * 0.05).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b, bs, _, _ = R.quantize_128x128(w)
    sizes = torch.tensor([m // 2, 0, m - m // 2], dtype=torch.int64, device=DEV)
    return dict(a=aq, a_scales=a_s, b=b, b_scales=bs, groups=sizes)


def _misaligned_bf16(m, n):
    return torch.empty(m * n + 8, dtype=BF16, device=DEV)[4:][: m * n].view(m, n)


M_BAD = [
    ("a dtype", lambda a: a.update(a=a["a"].float()), TypeError, "a must have dtype float8_e4m3fn"),
    ("b 2-D", lambda a: a.update(b=a["b"][0]), ValueError, "b must be 3-D"),
    ("K differs", lambda a: a.update(b=a["b"][:, :, :128].contiguous()), ValueError, "K differs"),
    ("b_scales shape", lambda a: a.update(b_scales=a["b_scales"][:, :1].contiguous()), ValueError, r"b_scales must be \["),
    ("a_scales layout", lambda a: a.update(a_scales=a["a_scales"].contiguous()), ValueError, "M-contiguous view"),
    ("groups dtype", lambda a: a.update(groups=a["groups"].float()), TypeError, "int32 or int64"),
    ("groups length", lambda a: a.update(groups=a["groups"][:2]), ValueError, "G sizes or G\\+1 offsets"),
    ("groups on cpu", lambda a: a.update(groups=a["groups"].cpu()), ValueError, "one device"),
    ("b_scales on cpu", lambda a: a.update(b_scales=a["b_scales"].cpu()), ValueError, "one device"),
    ("out dtype", lambda a: a.update(out=torch.empty(200, 256, device=DEV)), TypeError, "out must have dtype bfloat16"),
    ("out shape", lambda a: a.update(out=torch.empty(100, 256, dtype=BF16, device=DEV)), ValueError, r"out must be \[M, N\]"),
    ("out misaligned", lambda a: a.update(out=_misaligned_bf16(200, 256)), ValueError, "out must start 16-byte aligned"),
    ("out strided", lambda a: a.update(out=torch.empty(200, 512, dtype=BF16, device=DEV)[:, ::2]), ValueError, "unit column stride"),
    ("block_n", lambda a: a.update(block_n=64), ValueError, "block_n must be"),
    ("block_m", lambda a: a.update(block_m=64), ValueError, "block_m must be"),
    ("block_m 192 wide", lambda a: a.update(block_m=192, block_n=256), ValueError, "block_m=192 tiles are 128 wide"),
]


@pytest.mark.parametrize("name,mutate,exc,match", M_BAD, ids=[c[0] for c in M_BAD])
def test_m_grouped_bad_input_refused_by_op_and_explained_by_wrapper(name, mutate, exc, match):
    args = _m_args()
    mutate(args)
    out = args.pop("out", None)
    block_n, block_m = args.pop("block_n", 0), args.pop("block_m", 0)
    op_out = out if out is not None else torch.empty(200, 256, dtype=BF16, device=DEV)
    with pytest.raises((TypeError, ValueError)):  # the op alone refuses: a compiled graph cannot let it through
        torch.ops.megatron_tma.m_grouped_fp8_gemm_out(
            args["a"], args["a_scales"], args["b"], args["b_scales"], args["groups"], op_out, block_n, block_m)
    with pytest.raises(exc, match=match):  # and the wrapper still says what is wrong, in its own words
        gemm.m_grouped_fp8_gemm(**args, out=out, block_n=block_n, block_m=block_m)


def test_m_grouped_k_and_n_rules_on_gpu():
    gen = torch.Generator(device=DEV).manual_seed(1)
    aq, a_s = R.quantize_1x128(torch.randn(64, 128, generator=gen, device=DEV).bfloat16())
    b = torch.zeros(1, 40, 128, dtype=torch.float8_e4m3fn, device=DEV)
    groups = torch.tensor([64], device=DEV)
    with pytest.raises(ValueError, match="N must be a positive multiple of 16"):
        torch.ops.megatron_tma.m_grouped_fp8_gemm_out(aq, a_s, b, torch.ones(1, 1, 1, device=DEV), groups,
                                                      torch.empty(64, 40, dtype=BF16, device=DEV), 0)
    with pytest.raises(ValueError, match="N must be a positive multiple of 16"):
        gemm.m_grouped_fp8_gemm(aq, a_s, b, torch.ones(1, 1, 1, device=DEV), groups)


def test_m_grouped_checked_groups_give_the_same_bits():
    args = _m_args(m=3000, n=1408, k=1024, g=3, seed=5)
    raw = gemm.m_grouped_fp8_gemm(**args)
    checked = check_groups(args["groups"], 3, m_total=3000)
    into = torch.full_like(raw, float("nan"))
    assert gemm.m_grouped_fp8_gemm(**{**args, "groups": checked}, out=into) is into
    assert torch.equal(into, raw)
    # groups as a strided view: the op refuses it, the wrapper makes it contiguous, the result is the same
    strided = torch.stack([args["groups"], args["groups"]], 1)[:, 0]
    assert not strided.is_contiguous()
    with pytest.raises(ValueError, match="groups must be a contiguous"):
        torch.ops.megatron_tma.m_grouped_fp8_gemm_out(args["a"], args["a_scales"], args["b"], args["b_scales"],
                                                      strided, torch.empty_like(raw), 0, 0)
    assert torch.equal(gemm.m_grouped_fp8_gemm(**{**args, "groups": strided}), raw)


def _k_args(sizes=(100, 0, 60), n=64, k=128, seed=2):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    sizes = torch.tensor(sizes, dtype=torch.int64, device=DEV)
    m = int(sizes.sum())
    xt, xs = R.quantize_grouped_128x1(torch.randn(m, k, generator=gen, device=DEV).bfloat16(), sizes)
    dyt, dys = R.quantize_grouped_128x1(torch.randn(m, n, generator=gen, device=DEV).bfloat16(), sizes)
    return dict(dy_t=dyt, dy_t_scales=dys, x_t=xt, x_t_scales=xs, groups=sizes)


def _repitched(t, pitch):
    """The same [rows, P] bytes in a wider row-major buffer (row pitch `pitch`)."""
    buf = torch.zeros(t.shape[0], pitch, dtype=torch.uint8, device=t.device)
    buf[:, : t.shape[1]] = t.view(torch.uint8)
    return buf.view(torch.float8_e4m3fn)[:, : t.shape[1]]


# _k_args(): M = 160, G = 3, so P = 256 + 384 = 640 and MB = 1 + 3 = 4 (the 128-aligned layout, docs/design.md §4).
K_BAD = [
    ("dy_t dtype", lambda a: a.update(dy_t=a["dy_t"].float()), TypeError, "dy_t must have dtype float8_e4m3fn"),
    ("x_t column-major", lambda a: a.update(x_t=a["x_t"].t().contiguous().t()), ValueError,
     "x_t must be the token-contiguous"),
    ("x_t pitch not a multiple of 16", lambda a: a.update(x_t=_repitched(a["x_t"], 648)), ValueError,
     "x_t must be the token-contiguous"),
    ("pitches differ", lambda a: a.update(x_t=_repitched(a["x_t"], 656)), ValueError, "the same row pitch"),
    ("P differs", lambda a: a.update(x_t=a["x_t"][:, :192]), ValueError, "the same token columns P"),
    ("P not a multiple of 16", lambda a: a.update(dy_t=a["dy_t"][:, :200], x_t=a["x_t"][:, :200]), ValueError,
     r"P \(the token columns of dy_t and x_t\) must be a multiple of 16"),
    ("old [K, M] layout", lambda a: a.update(dy_t=a["dy_t"][:, :160], x_t=a["x_t"][:, :160]), ValueError,
     r"inconsistent wgrad operands: P >= 128 MB"),
    ("scales of another M", lambda a: a.update(dy_t_scales=torch.zeros(6, 64, device=DEV),
                                                x_t_scales=torch.zeros(6, 128, device=DEV)),
     ValueError, "inconsistent wgrad operands"),
    ("scales rows", lambda a: a.update(x_t_scales=a["x_t_scales"][:-1].contiguous()), ValueError, "token-block scales"),
    ("fewer scale rows than groups", lambda a: a.update(dy_t_scales=a["dy_t_scales"][:2].contiguous(),
                                                         x_t_scales=a["x_t_scales"][:2].contiguous()),
     ValueError, r"M_total // 128 \+ G >= G rows"),
    ("groups length", lambda a: a.update(groups=a["groups"][:2], num_groups=3), ValueError, "G sizes or G\\+1 offsets"),
    ("groups on cpu", lambda a: a.update(groups=a["groups"].cpu()), ValueError, "one device"),
    ("x_t_scales on cpu", lambda a: a.update(x_t_scales=a["x_t_scales"].cpu()), ValueError, "one device"),
    ("out shape", lambda a: a.update(out=torch.zeros(3, 64, 256, device=DEV)), ValueError, r"out must be \[G, N, K\]"),
    ("out dtype", lambda a: a.update(out=torch.zeros(3, 64, 128, dtype=torch.float16, device=DEV)), TypeError,
     "out must have dtype"),
    ("accumulate into bf16", lambda a: a.update(out=torch.zeros(3, 64, 128, dtype=BF16, device=DEV), accumulate=True),
     TypeError, "accumulate=True needs an FP32 out"),
    ("out_dtype", lambda a: a.update(out_dtype=torch.float16), TypeError, "out_dtype must be"),
]


@pytest.mark.parametrize("name,mutate,exc,match", K_BAD, ids=[c[0] for c in K_BAD])
def test_k_grouped_bad_input_refused_by_op_and_explained_by_wrapper(name, mutate, exc, match):
    """The op takes G from out (here G = 3), the wrapper from out, num_groups or the sizes: both refuse."""
    args = _k_args()
    mutate(args)
    out, accumulate = args.pop("out", None), args.pop("accumulate", False)
    out_dtype, num_groups = args.pop("out_dtype", torch.float32), args.pop("num_groups", None)
    op_out = out if out is not None else torch.zeros(3, 64, 128, dtype=out_dtype, device=DEV)
    with pytest.raises((TypeError, ValueError)):
        torch.ops.megatron_tma.k_grouped_fp8_gemm_out(
            args["dy_t"], args["dy_t_scales"], args["x_t"], args["x_t_scales"], args["groups"], op_out, accumulate)
    with pytest.raises(exc, match=match):
        gemm.k_grouped_fp8_gemm(**args, out=out, accumulate=accumulate, out_dtype=out_dtype, num_groups=num_groups)


@pytest.mark.parametrize("dtype,accumulate", [(torch.float32, False), (torch.float32, True), (BF16, False)])
def test_k_grouped_out_at_an_element_offset(dtype, accumulate):
    """An out that starts at an odd element (a main_grad view) takes the register epilogue: the TMA path's bits."""
    args = _k_args()
    g, n, k = 3, 64, 128
    storage = torch.randn(g * n * k + 1, device=DEV).to(dtype)
    if not accumulate:
        storage.fill_(float("nan"))  # every element must be written
    odd = storage[1:].view(g, n, k)
    aligned = storage[1:].clone().view(g, n, k)
    before = odd.clone()
    assert odd.data_ptr() % 16 != 0 and aligned.data_ptr() % 16 == 0
    assert gemm.k_grouped_fp8_gemm(**args, out=odd, accumulate=accumulate) is odd
    gemm.k_grouped_fp8_gemm(**args, out=aligned, accumulate=accumulate)
    assert torch.equal(odd, aligned)
    # and what a call without out computes: the same bits, added to what was there with accumulate (one FP32 add)
    fresh = gemm.k_grouped_fp8_gemm(**args, out_dtype=dtype)
    assert torch.equal(odd, before + fresh if accumulate else fresh)
    assert fresh.abs().sum() > 0


def test_k_grouped_accumulate_needs_out_on_gpu():
    with pytest.raises(ValueError, match="accumulate=True needs the FP32 buffer"):
        gemm.k_grouped_fp8_gemm(**_k_args(), accumulate=True)


@pytest.mark.parametrize("out_dtype", [torch.float32, BF16])
def test_k_grouped_checked_groups_and_offsets_give_the_same_bits(out_dtype):
    args = _k_args(sizes=(700, 0, 129, 1000), n=256, k=384, seed=7)
    raw = gemm.k_grouped_fp8_gemm(**args, out_dtype=out_dtype)
    c = torch.randn(raw.shape, device=DEV)
    raw_acc = gemm.k_grouped_fp8_gemm(**args, out=c.clone(), accumulate=True)
    checked = check_groups(args["groups"], 4)
    got = gemm.k_grouped_fp8_gemm(**{**args, "groups": checked}, out_dtype=out_dtype)
    got_acc = c.clone()
    assert gemm.k_grouped_fp8_gemm(**{**args, "groups": checked}, out=got_acc, accumulate=True) is got_acc
    assert got.dtype == out_dtype and torch.equal(got, raw) and torch.equal(got_acc, raw_acc)
    # offsets [G+1]: out is allocated with G = num_groups, and the op reads them as offsets
    offsets = torch.cat([args["groups"].new_zeros(1), args["groups"].cumsum(0)])
    from_offsets = gemm.k_grouped_fp8_gemm(**{**args, "groups": offsets}, num_groups=4, out_dtype=out_dtype)
    assert from_offsets.shape == raw.shape and torch.equal(from_offsets, raw)


def test_torch_compile_runs_the_ops_and_the_wrappers():
    """The ops' fake implementations let torch.compile trace them with no graph break (they mutate `out`), and the
    wrappers (their checks run at trace time; the cached op lookup may break the graph) give the eager bits."""
    m_args = _m_args(m=1000, n=384, k=256, g=3, seed=9)
    k_args = _k_args(sizes=(300, 0, 200), n=128, k=256, seed=9)
    ops = _ext.ops()

    def raw(a, a_scales, b, b_scales, groups, dy_t, dy_t_scales, x_t, x_t_scales, k_groups):
        out = torch.empty(a.shape[0], b.shape[1], dtype=BF16, device=a.device)
        ops.m_grouped_fp8_gemm_out(a, a_scales, b, b_scales, groups, out, 0)
        dw = torch.empty(3, dy_t.shape[0], x_t.shape[0], device=a.device)
        ops.k_grouped_fp8_gemm_out(dy_t, dy_t_scales, x_t, x_t_scales, k_groups, dw, False)
        return out, dw

    flat = (*m_args.values(), *[k_args[n] for n in ("dy_t", "dy_t_scales", "x_t", "x_t_scales", "groups")])
    eager = raw(*flat)
    compiled = torch.compile(raw, fullgraph=True)(*flat)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])

    def wrappers(m_args, k_args):
        return gemm.m_grouped_fp8_gemm(**m_args), gemm.k_grouped_fp8_gemm(**k_args, out_dtype=BF16)

    got = torch.compile(wrappers)(m_args, k_args)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1].bfloat16())
