"""The GEMMs' argument rules, run once per call on every backend (megatron_tma/gemm.py), and group descriptions
checked once (megatron_tma.groups.Groups), on the CPU.

The op path (`backend="auto"`: `torch.ops.megatron_tma.*`, whose kernel the device picks) is exercised with a
recording stand-in for the op: a bad input raises the API's error before any op, with the same wording as on the
reference backend, and a good one reaches the op once with the groups' tensor. (tests/test_gemm_op_preconditions_gpu.py checks on the H200 that the real
ops refuse what these rules refuse.)"""
import pytest
import torch

from megatron_tma import gemm, ops
from megatron_tma import groups as G
from megatron_tma import reference as R
from megatron_tma.groups import Groups, check_groups


class RecordingOp:
    """Stands in for the GEMM ops: records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def op_path(monkeypatch):
    """The ops that the wrappers' `backend="auto"` calls record instead of running."""
    op = RecordingOp()
    for name in ("m_grouped_fp8_gemm_out", "k_grouped_fp8_gemm_out"):
        monkeypatch.setitem(ops._OPS, name, op)
    return op


def _m_args():
    gen = torch.Generator().manual_seed(3)
    aq, a_s = R.quantize_1x128(torch.randn(200, 256, generator=gen).bfloat16())
    b, bs, _, _ = R.quantize_128x128((torch.randn(3, 128, 256, generator=gen) * 0.05).bfloat16())
    return dict(a=aq, a_scales=a_s, b=b, b_scales=bs, groups=torch.tensor([100, 0, 100]))


def _k_args():
    gen = torch.Generator().manual_seed(4)
    sizes = torch.tensor([100, 0, 60])
    xt, xs = R.quantize_grouped_128x1(torch.randn(160, 128, generator=gen).bfloat16(), sizes)
    dyt, dys = R.quantize_grouped_128x1(torch.randn(160, 64, generator=gen).bfloat16(), sizes)
    return dict(dy_t=dyt, dy_t_scales=dys, x_t=xt, x_t_scales=xs, groups=sizes)


M_BAD = [
    ({"a": lambda a: a.float()}, {}, TypeError, "a must have dtype float8_e4m3fn"),
    ({"b": lambda b: b[:, :, :128].contiguous()}, {}, ValueError, "K differs"),
    ({"a_scales": lambda s: s.contiguous()}, {}, ValueError, "M-contiguous view"),
    ({"groups": lambda g: g[:2]}, {}, ValueError, "G sizes or G\\+1 offsets"),
    ({"groups": lambda g: g.float()}, {}, TypeError, "int32 or int64"),
    ({"groups": lambda g: g + 1}, {}, ValueError, "group sizes sum to 203, but the data has M_total=200"),
    ({}, {"out": torch.empty(200, 128)}, TypeError, "out must have dtype bfloat16"),
    ({}, {"out": torch.empty(100, 128, dtype=torch.bfloat16)}, ValueError, r"out must be \[M, N\]"),
    ({}, {"block_n": 64}, ValueError, "block_n must be"),
    ({}, {"block_m": 192, "block_n": 256}, ValueError, "block_m=192 tiles are 128 wide"),
]


def test_m_grouped_good_input_reaches_the_op_once_with_the_groups_tensor(op_path):
    args = _m_args()
    out = gemm.m_grouped_fp8_gemm(**args, block_n=128)
    assert len(op_path.calls) == 1 and out.shape == (200, 128) and out.dtype == torch.bfloat16
    call = op_path.calls[0]
    assert call[0] is args["a"] and call[4] is args["groups"] and call[5] is out and call[6:] == (128, 0)
    checked = check_groups(args["groups"], 3, m_total=200)
    given = torch.empty(200, 128, dtype=torch.bfloat16)
    assert gemm.m_grouped_fp8_gemm(**{**args, "groups": checked}, out=given) is given
    assert op_path.calls[1][4] is checked.tensor and op_path.calls[1][5] is given


K_BAD = [
    ({"dy_t": lambda t: t.float()}, {}, TypeError, "dy_t must have dtype float8_e4m3fn"),
    ({"x_t": lambda t: t[:, :192]}, {}, ValueError, "the same token columns P"),
    ({"dy_t_scales": lambda s: s[:2].contiguous(), "x_t_scales": lambda s: s[:2].contiguous()}, {}, ValueError,
     r"M_total // 128 \+ G >= G rows"),
    ({"groups": lambda g: g * 4}, {}, ValueError, "token columns, but the wgrad operands have P = 640"),
    ({}, {"out": torch.zeros(3, 64, 256)}, ValueError, r"out must be \[G, N, K\]"),
    ({}, {"out": torch.zeros(3, 64, 128, dtype=torch.bfloat16), "accumulate": True}, TypeError,
     "accumulate=True needs an FP32 out"),
    ({}, {"accumulate": True}, ValueError, "accumulate=True needs the FP32 buffer"),
    ({}, {"out_dtype": torch.float16}, TypeError, "out_dtype must be"),
    ({}, {"num_groups": 4}, ValueError, "G sizes or G\\+1 offsets with G=4"),
    # issue 34 item 8: sizes that cover fewer tokens than the operands hold (a partial dW before)
    ({"groups": lambda g: g - torch.tensor([0, 0, 40])}, {}, ValueError,
     r"group sizes sum to M_total=120, but the wgrad operands \(P=640 token columns, MB=4 scale rows\)"),
    ({"groups": lambda g: torch.tensor([0, 100, 100, 120])}, {"num_groups": 3}, ValueError,
     "group sizes sum to M_total=120"),
    # within the operands' rounding only m_total tells (the sizes must then sum to it)
    ({"groups": lambda g: g - torch.tensor([1, 0, 0])}, {"m_total": 160}, ValueError,
     "group sizes sum to 159, but the data has M_total=160"),
    ({}, {"m_total": 150}, ValueError, "group sizes sum to 160, but the data has M_total=150"),
    ({"groups": lambda g: g - torch.tensor([0, 0, 40])}, {"m_total": 120}, ValueError,
     "must be quantize_grouped_128x1's operands of m_total=120 tokens"),
]


BAD = [("m_grouped", *case) for case in M_BAD] + [("k_grouped", *case) for case in K_BAD]


@pytest.mark.parametrize("which,mutate,extra,exc,match", BAD)
def test_bad_input_gets_one_error_on_both_backends_and_never_reaches_the_op(op_path, which, mutate, extra, exc, match):
    args = _m_args() if which == "m_grouped" else _k_args()
    fn = gemm.m_grouped_fp8_gemm if which == "m_grouped" else gemm.k_grouped_fp8_gemm
    args.update({k: f(args[k]) for k, f in mutate.items()})
    messages = []
    for backend in ("auto", "reference"):  # "auto" takes the (recorded) op path
        with pytest.raises(exc, match=match) as err:
            fn(**args, **extra, backend=backend)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and op_path.calls == []


def test_both_gemms_refuse_sizes_that_cover_fewer_tokens_than_their_operands(op_path):
    """Issue 34 item 8: one rule for both GEMMs. The M-grouped GEMM refused sizes that leave rows of `a` in no group;
    the K-grouped one took the same sizes and returned the dW of the covered tokens only."""
    m, k = _m_args(), _k_args()
    for args, fn, short in ((m, gemm.m_grouped_fp8_gemm, torch.tensor([100, 0, 60])),
                            (k, gemm.k_grouped_fp8_gemm, torch.tensor([100, 0, 20]))):
        for backend in ("auto", "reference"):
            with pytest.raises(ValueError, match="group sizes sum to"):
                fn(**{**args, "groups": short}, backend=backend)
    assert op_path.calls == []


def test_k_grouped_takes_g_from_out_num_groups_or_sizes(op_path):
    args = _k_args()
    dw = gemm.k_grouped_fp8_gemm(**args, out_dtype=torch.bfloat16)
    assert dw.shape == (3, 64, 128) and dw.dtype == torch.bfloat16 and op_path.calls[-1][5] is dw
    offsets = torch.tensor([0, 100, 100, 160])
    assert gemm.k_grouped_fp8_gemm(**{**args, "groups": offsets}, num_groups=3).shape == (3, 64, 128)
    c = torch.zeros(3, 64, 128)
    assert gemm.k_grouped_fp8_gemm(**{**args, "groups": offsets}, out=c, accumulate=True) is c
    assert op_path.calls[-1][4] is offsets and op_path.calls[-1][6] is True


# ------------------------------------------------------------------------------------------------------------------
# Groups: checked once, passed down typed
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def raw_checks(monkeypatch):
    """Counts the checks of raw group tensors (what a `Groups` spares its later users)."""
    calls = []
    real = G._check_group_tensor

    def counting(groups, name):
        calls.append(name)
        return real(groups, name)

    monkeypatch.setattr(G, "_check_group_tensor", counting)
    return calls


def test_check_groups_returns_what_it_found(groups_format):
    from _dists import group_tensor

    t = group_tensor([3, 0, 5, 1], groups_format)
    g = check_groups(t, num_groups=4, m_total=9)
    assert type(g) is Groups and g.num_groups == 4 and g.m_total == 9
    assert g.is_offsets == (groups_format[0] == "offsets") and g.tensor.dtype == groups_format[1]
    assert torch.equal(g.tensor, t) and G.host_group_sizes(g) == [3, 0, 5, 1]


def test_a_checked_groups_is_matched_not_rechecked(raw_checks):
    g = check_groups(torch.tensor([100, 0, 100]), 3, m_total=200)
    assert raw_checks == ["groups"]
    assert check_groups(g, 3, m_total=200, device="cpu") is g and raw_checks == ["groups"]
    with pytest.raises(ValueError, match="groups describe 3 groups, but this call has G=4"):
        check_groups(g, 4)
    with pytest.raises(ValueError, match="groups were checked for M_total=200 rows, but this call's data has 180"):
        check_groups(g, 3, m_total=180)
    with pytest.raises(ValueError, match="must be on the data's device meta"):
        check_groups(g, 3, device="meta")
    # checked without rows (the wgrad GEMM's case), then used with them: the values are checked now (CPU)
    no_rows = check_groups(torch.tensor([100, 0, 100]), 3)
    assert check_groups(no_rows, 3, m_total=200).m_total == 200
    with pytest.raises(ValueError, match="group sizes sum to 200, but the data has M_total=180"):
        check_groups(no_rows, 3, m_total=180)


@pytest.mark.parametrize("tensor,num_groups,is_offsets", [
    (torch.tensor([0, 120, 120, 200]), 3, False),  # offsets labelled as sizes
    (torch.tensor([120, 0, 80]), 3, True),  # sizes labelled as offsets
    (torch.tensor([120.0, 0.0, 80.0]), 3, False),  # not an integer tensor
    (torch.tensor([[120, 0, 80]]), 3, False),  # not 1-D
])
def test_a_hand_built_groups_that_does_not_fit_itself_is_refused(tensor, num_groups, is_offsets):
    """The C++ ops read sizes or offsets from the tensor's length, the reference from `is_offsets`: a mislabelled
    `Groups` would give different results on the two backends, so it is refused."""
    with pytest.raises(ValueError, match="a Groups whose tensor does not match it"):
        check_groups(Groups(tensor, num_groups, is_offsets, 200), 3, m_total=200)


def test_the_gemms_take_checked_groups_without_checking_them_again(raw_checks):
    args = _m_args()
    checked = check_groups(args["groups"], 3, m_total=200)
    raw_checks.clear()
    y = gemm.m_grouped_fp8_gemm(**{**args, "groups": checked})
    assert raw_checks == [] and torch.equal(y, gemm.m_grouped_fp8_gemm(**args))
    k = _k_args()
    checked = check_groups(k["groups"], 3)
    raw_checks.clear()
    dw = gemm.k_grouped_fp8_gemm(**{**k, "groups": checked})
    assert raw_checks == [] and torch.equal(dw, gemm.k_grouped_fp8_gemm(**k))
    with pytest.raises(ValueError, match="groups describe 3 groups, but this call has G=2"):
        gemm.m_grouped_fp8_gemm(**{**args, "b": args["b"][:2], "b_scales": args["b_scales"][:2],
                                   "groups": check_groups(args["groups"], 3, m_total=200)})


@pytest.mark.parametrize("recompute_activation", [False, True])
def test_the_expert_mlp_checks_its_arguments_once_per_step(raw_checks, recompute_activation, monkeypatch):
    """Forward and backward of the FP8 expert MLP (2 linears: 4-5 quantizer and 6 GEMM calls) check the raw
    tokens_per_expert once; the quantizers and GEMMs then run on the `Groups` and on operands the step made itself,
    without their public argument rules."""
    from megatron_tma import quant
    from megatron_tma.mlp import GroupedFP8MLP

    rule_runs = []
    for module, name in ((gemm, "_check_m_grouped_args"), (gemm, "_check_k_grouped_args"),
                         (quant, "_check_grouped_args"), (quant, "_check_aligned_input")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: (rule_runs.append(_name),
                                                                                     _real(*a, **k))[1])

    torch.manual_seed(0)
    mlp = GroupedFP8MLP(3, 128, 128, backend="reference", recompute_activation=recompute_activation)
    x = torch.randn(200, 128).bfloat16().requires_grad_()
    tokens = torch.tensor([120, 0, 80])
    probs = torch.rand(200, requires_grad=True)
    raw_checks.clear()
    y, _ = mlp(x, tokens, probs)
    y.float().square().sum().backward()
    assert raw_checks == ["tokens_per_expert"]
    assert rule_runs == ["_check_aligned_input"] * 2  # each linear's weight quantization (once per weight version)
    assert x.grad is not None and probs.grad is not None
    assert all(p.grad is not None for p in mlp.parameters())
