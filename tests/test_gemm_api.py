"""Python API of the grouped GEMMs on the CPU (reference backend): validation messages and the reference
result through the public entry point."""
import pytest
import torch

from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma.gemm import m_grouped_fp8_gemm


def _operands(m=200, n=256, k=256, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(g, n, k, generator=gen) * 0.05).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b, bs, _, _ = R.quantize_128x128(w)
    sizes = torch.tensor([m // 2, 0, m - m // 2], dtype=torch.int64)
    return aq, a_s, b, bs, sizes


def test_reference_backend_matches_reference_module():
    aq, a_s, b, bs, sizes = _operands()
    out = m_grouped_fp8_gemm(aq, a_s, b, bs, sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (200, 256)
    assert torch.equal(out, R.m_grouped_fp8_gemm(aq, a_s, b, bs, sizes))
    assert T.diff(out.double(), T.m_grouped_ref64(aq, a_s, b, bs, sizes)) < 1e-3


def test_out_argument_is_filled_and_returned():
    aq, a_s, b, bs, sizes = _operands()
    out = torch.full((200, 256), float("nan"), dtype=torch.bfloat16)
    ret = m_grouped_fp8_gemm(aq, a_s, b, bs, sizes, out=out)
    assert ret is out and torch.equal(out, R.m_grouped_fp8_gemm(aq, a_s, b, bs, sizes))


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(a=a["a"].float()), TypeError, "a must have dtype float8_e4m3fn"),
        (lambda a: a.update(b=a["b"][0]), ValueError, "b must be 3-D"),
        (lambda a: a.update(b=a["b"][:, :, :128].contiguous()), ValueError, "K differs"),
        (lambda a: a.update(b_scales=a["b_scales"][:, :1].contiguous()), ValueError, r"b_scales must be \[G, ceil\(N/128\), K/128\]"),
        (lambda a: a.update(a_scales=a["a_scales"].contiguous()), ValueError, "M-contiguous view"),
        (lambda a: a.update(groups=a["groups"].float()), TypeError, "int32 or int64"),
        (lambda a: a.update(groups=torch.tensor([1, 2], dtype=torch.int64)), ValueError, "G sizes or G\\+1 offsets"),
        (lambda a: a.update(groups=torch.tensor([100, 0, 99], dtype=torch.int64)), ValueError, "sum"),
        (lambda a: a.update(groups=torch.tensor([-1, 101, 100], dtype=torch.int64)), ValueError, "negative"),
        (lambda a: a.update(out=torch.empty(200, 256)), TypeError, "out must have dtype bfloat16"),
        (lambda a: a.update(out=torch.empty(100, 256, dtype=torch.bfloat16)), ValueError, r"out must be \[M, N\]"),
        (lambda a: a.update(out=torch.empty(200 * 256 + 8, dtype=torch.bfloat16)[4:][: 200 * 256].view(200, 256)),
         ValueError, "out must start 16-byte aligned"),
        (lambda a: a.update(backend="tpu"), ValueError, "backend must be"),
        (lambda a: a.update(block_n=64), ValueError, "block_n must be"),
        (lambda a: a.update(block_m=64), ValueError, "block_m must be"),
        (lambda a: a.update(block_m=192, block_n=256), ValueError, "block_m=192 tiles are 128 wide"),
    ],
)
def test_validation_messages(mutate, exc, match):
    aq, a_s, b, bs, sizes = _operands()
    args = dict(a=aq, a_scales=a_s, b=b, b_scales=bs, groups=sizes)
    mutate(args)
    with pytest.raises(exc, match=match):
        m_grouped_fp8_gemm(**args)


def test_k_and_n_rules():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 192, generator=gen).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b = torch.zeros(1, 256, 192, dtype=torch.float8_e4m3fn)
    bs = torch.ones(1, 2, 2)
    with pytest.raises(ValueError, match="K must be a positive multiple of 128"):
        m_grouped_fp8_gemm(aq, a_s, b, bs, torch.tensor([64]))
    x = torch.randn(64, 128, generator=gen).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b = torch.zeros(1, 40, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="N must be a positive multiple of 16"):
        m_grouped_fp8_gemm(aq, a_s, b, torch.ones(1, 1, 1), torch.tensor([64]))


def test_cuda_backend_requested_without_gpu_is_a_clear_error():
    aq, a_s, b, bs, sizes = _operands()
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        m_grouped_fp8_gemm(aq, a_s, b, bs, sizes, backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_k_grouped_out_at_an_element_offset(dtype, accumulate):
    """An out view that starts at an odd element (e.g. a slice of Megatron's flat main_grad buffer) is accepted on
    every backend and gets the same values as an aligned one, and the values of a call without `out` (plus what
    was there, when accumulating)."""
    from megatron_tma.gemm import k_grouped_fp8_gemm

    if accumulate and dtype != torch.float32:
        pytest.skip("accumulate needs FP32")
    gen = torch.Generator().manual_seed(2)
    sizes = torch.tensor([100, 0, 60], dtype=torch.int64)
    x = torch.randn(160, 128, generator=gen).bfloat16()
    dy = torch.randn(160, 64, generator=gen).bfloat16()
    xt, xs = R.quantize_grouped_128x1(x, sizes)
    dyt, dys = R.quantize_grouped_128x1(dy, sizes)
    storage = torch.randn(3 * 64 * 128 + 1, generator=gen).to(dtype)
    if not accumulate:  # poisoned: every element must be written
        storage.fill_(float("nan"))
    odd = storage[1:].view(3, 64, 128)
    before = odd.clone()
    aligned = odd.clone()
    assert k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=odd, accumulate=accumulate) is odd
    k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=aligned, accumulate=accumulate)
    assert torch.equal(odd, aligned)
    want = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out_dtype=dtype)
    assert torch.equal(odd, before + want if accumulate else want)


@pytest.mark.parametrize("name,args", [("m_grouped_tile", (65536, 4096, 8)), ("k_grouped_tile", (4096, 4096, 8))])
def test_tile_queries_without_the_extension_say_what_they_need(name, args):
    """The tile queries read the launchers' choice, so they need the built extension; elsewhere a clear error
    (the choices themselves are tested on the CPU in test_{m,k}_grouped_tile_choice.py, the queries on the GPU)."""
    import megatron_tma
    from megatron_tma import _ext

    assert getattr(megatron_tma, name) is getattr(megatron_tma.gemm, name)
    if _ext.has_extension():
        pytest.skip("the extension is built here: tests/test_{m_grouped_gpu,k_grouped_tiles_gpu}.py cover the query")
    with pytest.raises(RuntimeError, match=f"{name} needs the CUDA extension"):
        getattr(megatron_tma, name)(*args)


# ------------------------------------------------------------------------------------------------------------------
# K-grouped (wgrad): the 128-aligned layout's rules (docs/design.md §4, docs/layouts.md)
# ------------------------------------------------------------------------------------------------------------------
K_SIZES = [300, 0, 60]  # M = 360, G = 3: P = 384 + 384 = 768, MB = 2 + 3 = 5


def _k_args(sizes=K_SIZES, n=64, k=128, seed=5):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(sizes, dtype=torch.int64)
    m = int(sizes.sum())
    xt, xs = R.quantize_grouped_128x1(torch.randn(m, k, generator=gen).bfloat16(), sizes)
    dyt, dys = R.quantize_grouped_128x1(torch.randn(m, n, generator=gen).bfloat16(), sizes)
    return dict(dy_t=dyt, dy_t_scales=dys, x_t=xt, x_t_scales=xs, groups=sizes)


def _repitched(t, pitch):
    """The same [rows, P] bytes in a wider row-major buffer (row pitch `pitch`)."""
    buf = torch.zeros(t.shape[0], pitch, dtype=torch.uint8)
    buf[:, : t.shape[1]] = t.view(torch.uint8)
    return buf.view(torch.float8_e4m3fn)[:, : t.shape[1]]


def test_k_grouped_num_groups_offsets_and_out():
    from megatron_tma.gemm import k_grouped_fp8_gemm

    args = _k_args()
    assert args["x_t"].shape == (128, 768) and args["x_t"].is_contiguous()
    want = k_grouped_fp8_gemm(**args)
    assert want.shape == (3, 64, 128)
    assert torch.equal(want, R.k_grouped_fp8_gemm(*args.values()))
    offsets = torch.tensor([0, 300, 300, 360], dtype=torch.int32)
    assert torch.equal(k_grouped_fp8_gemm(**{**args, "groups": offsets}, num_groups=3), want)
    out = torch.full((3, 64, 128), float("nan"))
    assert k_grouped_fp8_gemm(**{**args, "groups": offsets}, out=out) is out and torch.equal(out, want)
    assert torch.equal(k_grouped_fp8_gemm(**args, num_groups=3), want)
    # a wider row pitch (a multiple of 16, the same for both operands) reads the same columns
    wide = {**args, "dy_t": _repitched(args["dy_t"], 896), "x_t": _repitched(args["x_t"], 896)}
    assert torch.equal(k_grouped_fp8_gemm(**wide), want)


def test_k_grouped_no_tokens():
    """M == 0: the quantizers give [K, 128 G] zeros; the GEMM writes zeros, or leaves C when accumulating."""
    from megatron_tma.gemm import k_grouped_fp8_gemm
    from megatron_tma.quant import quantize_grouped_128x1

    sizes = torch.zeros(4, dtype=torch.int32)
    xt, xs = quantize_grouped_128x1(torch.zeros(0, 128, dtype=torch.bfloat16), sizes)
    dyt, dys = quantize_grouped_128x1(torch.zeros(0, 64, dtype=torch.bfloat16), sizes)
    assert xt.shape == (128, 512) and dyt.shape == (64, 512) and xs.shape == (4, 128)
    out = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=torch.full((4, 64, 128), float("nan")))
    assert torch.equal(out, torch.zeros_like(out))
    c = torch.randn(4, 64, 128)
    assert torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=c.clone(), accumulate=True), c)


F8 = torch.float8_e4m3fn
K_BAD = [
    ("dy_t dtype", lambda a: a.update(dy_t=a["dy_t"].float()), TypeError, "dy_t must have dtype float8_e4m3fn"),
    ("x_t column-major", lambda a: a.update(x_t=a["x_t"].t().contiguous().t()), ValueError,
     r"x_t must be the token-contiguous \[rows, P\] operand"),
    ("x_t pitch not a multiple of 16", lambda a: a.update(x_t=_repitched(a["x_t"], 776)), ValueError,
     r"x_t must be the token-contiguous .*row pitch a multiple of 16 and >= P"),
    ("pitches differ", lambda a: a.update(x_t=_repitched(a["x_t"], 784)), ValueError,
     "dy_t and x_t must have the same row pitch, got 768 and 784"),
    ("P differs", lambda a: a.update(x_t=a["x_t"][:, :192]), ValueError,
     "dy_t and x_t must have the same token columns P"),
    ("P not a multiple of 16", lambda a: a.update(dy_t=a["dy_t"][:, :200], x_t=a["x_t"][:, :200]), ValueError,
     r"P \(the token columns of dy_t and x_t\) must be a multiple of 16 .*got P=200"),
    ("16-aligned layout's P", lambda a: a.update(dy_t=a["dy_t"][:, :416], x_t=a["x_t"][:, :416]), ValueError,
     r"inconsistent wgrad operands: P >= 128 MB must hold .*got P=416, G=3, MB=5"),
    ("scales of another M", lambda a: a.update(dy_t_scales=torch.zeros(7, 64), x_t_scales=torch.zeros(7, 128)),
     ValueError, r"inconsistent wgrad operands: .*got P=768, G=3, MB=7"),
    ("scale rows differ", lambda a: a.update(x_t_scales=a["x_t_scales"][:-1].contiguous()), ValueError,
     r"token-block scales must be \[MB, N\] and \[MB, K\] with one MB"),
    ("fewer scale rows than groups", lambda a: a.update(dy_t_scales=a["dy_t_scales"][:2].contiguous(),
                                                         x_t_scales=a["x_t_scales"][:2].contiguous()),
     ValueError, r"M_total // 128 \+ G >= G rows, got MB=2 for G=3"),
    ("offsets without num_groups", lambda a: a.update(groups=torch.tensor([0, 300, 300, 360])), ValueError,
     r"token columns, but the wgrad operands have P = 768 \(offsets \[G\+1\] need num_groups=G or out"),
    ("groups past P", lambda a: a.update(groups=torch.tensor([300, 0, 400])), ValueError,
     r"sum_g round_up\(M_g, 128\) = 896 token columns, but the wgrad operands have P = 768"),
    ("groups length", lambda a: a.update(groups=a["groups"][:2], num_groups=3), ValueError, r"G sizes or G\+1 offsets"),
    ("negative size", lambda a: a.update(groups=torch.tensor([300, -4, 64])), ValueError, "must be >= 0"),
    ("num_groups vs out", lambda a: a.update(out=torch.zeros(3, 64, 128), num_groups=2), ValueError,
     "out holds G=3 groups but num_groups=2"),
    ("num_groups 0", lambda a: a.update(num_groups=0), ValueError, "num_groups must be >= 1"),
    ("out shape", lambda a: a.update(out=torch.zeros(3, 64, 256)), ValueError,
     r"out must be \[G, N, K\] = \[3, 64, 128\]"),
    ("out dtype", lambda a: a.update(out=torch.zeros(3, 64, 128, dtype=torch.float16)), TypeError,
     "out must have dtype"),
    ("accumulate into bf16", lambda a: a.update(out=torch.zeros(3, 64, 128, dtype=torch.bfloat16), accumulate=True),
     TypeError, "accumulate=True needs an FP32 out"),
    ("accumulate without out", lambda a: a.update(accumulate=True), ValueError,
     "accumulate=True needs the FP32 buffer"),
    ("out_dtype", lambda a: a.update(out_dtype=torch.float16), TypeError, "out_dtype must be"),
    ("block_m", lambda a: a.update(block_m=64), ValueError, r"block_m must be 0 \(auto\), 128 or 192, got 64"),
]


@pytest.mark.parametrize("name,mutate,exc,match", K_BAD, ids=[c[0] for c in K_BAD])
def test_k_grouped_validation_messages(name, mutate, exc, match):
    from megatron_tma.gemm import k_grouped_fp8_gemm

    args = _k_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        k_grouped_fp8_gemm(**args)


def test_k_grouped_debug_checks_bound_the_groups_by_p(debug_checks):
    """With debug checks on the groups are read on the host and must fit the operands: sum round_up(M_g, 128) <= P
    (on the CPU they are checked anyway: the read is free)."""
    from megatron_tma.gemm import k_grouped_fp8_gemm

    args = _k_args()
    with pytest.raises(ValueError, match=r"= 896 token columns, but the wgrad operands have P = 768"):
        k_grouped_fp8_gemm(**{**args, "groups": torch.tensor([300, 0, 400])})
    assert k_grouped_fp8_gemm(**args).shape == (3, 64, 128)
