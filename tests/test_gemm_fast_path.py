"""The wrappers' fast path (megatron_tma/gemm.py, FAST_PATH) as control flow, on the CPU: `_ext.fast_op` is
replaced by a recording stand-in for the C++ op, so that what the wrapper does when the op accepts or refuses
an input can be checked without a GPU. (tests/test_gemm_fast_path_gpu.py checks, on the H200, that the real ops
refuse every input the Python checks refuse.)"""
import pytest
import torch

from megatron_tma import _ext, gemm
from megatron_tma import reference as R


class FakeOp:
    """Stands in for a C++ op: records each call; raises like a TORCH_CHECK when `refuse` is set."""

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def __call__(self, *args):
        self.calls.append(args)
        if self.refuse:
            raise RuntimeError("refused by the op")


@pytest.fixture
def fake_op(monkeypatch):
    op = FakeOp()
    monkeypatch.setattr(_ext, "fast_op", lambda name, backend, data: op if backend in ("auto", "cuda") else None)
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


def test_m_grouped_accepted_input_goes_to_the_op_only(fake_op):
    args = _m_args()
    out = gemm.m_grouped_fp8_gemm(**args, block_n=128)
    assert len(fake_op.calls) == 1 and out.shape == (200, 128) and out.dtype == torch.bfloat16
    call = fake_op.calls[0]
    assert call[0] is args["a"] and call[4] is args["groups"] and call[5] is out and call[6] == 128 and call[7] == 0
    given = torch.empty(200, 128, dtype=torch.bfloat16)
    assert gemm.m_grouped_fp8_gemm(**args, out=given) is given and fake_op.calls[1][5] is given


def test_m_grouped_refused_input_gets_the_python_error(fake_op):
    fake_op.refuse = True
    args = _m_args()
    with pytest.raises(TypeError, match="a must have dtype float8_e4m3fn"):
        gemm.m_grouped_fp8_gemm(**{**args, "a": args["a"].float()})
    with pytest.raises(ValueError, match="block_n must be"):
        gemm.m_grouped_fp8_gemm(**args, block_n=64)
    with pytest.raises(ValueError, match="block_m=192 tiles are 128 wide"):
        gemm.m_grouped_fp8_gemm(**args, block_m=192, block_n=192)
    assert len(fake_op.calls) == 3  # tried first each time


def test_m_grouped_refused_but_valid_input_runs_the_full_path(fake_op):
    """A refusal the Python checks do not explain (here on the CPU: the reference backend) still gives a result."""
    fake_op.refuse = True
    args = _m_args()
    assert torch.equal(gemm.m_grouped_fp8_gemm(**args), R.m_grouped_fp8_gemm(*args.values()))


def test_fast_path_off_reference_backend_and_debug_checks_skip_the_op(fake_op, debug_checks):
    args = _m_args()
    gemm.m_grouped_fp8_gemm(**args)  # debug checks on (fixture): the full path, with host checks of the groups
    assert not fake_op.calls
    from megatron_tma.groups import set_debug_checks

    set_debug_checks(False)
    gemm.m_grouped_fp8_gemm(**args, backend="reference")
    gemm.FAST_PATH = False
    try:
        gemm.m_grouped_fp8_gemm(**args)
    finally:
        gemm.FAST_PATH = True
    assert not fake_op.calls


def test_k_grouped_fast_path_allocates_out_and_defers_what_it_cannot_check(fake_op):
    args = _k_args()
    out = gemm.k_grouped_fp8_gemm(**args, out_dtype=torch.bfloat16)
    assert len(fake_op.calls) == 1 and out.shape == (3, 64, 128) and out.dtype == torch.bfloat16
    assert fake_op.calls[0][5] is out and fake_op.calls[0][6] is False
    # accumulate without out, or an invalid out_dtype: the Python path decides, the op is not tried
    with pytest.raises(ValueError, match="accumulate=True needs the FP32 buffer"):
        gemm.k_grouped_fp8_gemm(**args, accumulate=True)
    with pytest.raises(TypeError, match="out_dtype must be"):
        gemm.k_grouped_fp8_gemm(**args, out=torch.zeros(3, 64, 128), out_dtype=torch.float16)
    assert len(fake_op.calls) == 1
    fake_op.refuse = True
    with pytest.raises(ValueError, match=r"out must be \[G, N, K\]"):
        gemm.k_grouped_fp8_gemm(**args, out=torch.zeros(3, 64, 256))
    assert len(fake_op.calls) == 2


def test_k_grouped_fast_path_takes_g_from_out_num_groups_or_sizes(fake_op):
    """The op takes G from out.shape[0]: the wrapper allocates out with G = num_groups (offsets [G+1] need it) or
    the number of sizes, and hands a given out through untouched."""
    args = _k_args()
    offsets = torch.tensor([0, 100, 100, 160])
    out = gemm.k_grouped_fp8_gemm(**{**args, "groups": offsets}, num_groups=3)
    assert out.shape == (3, 64, 128) and fake_op.calls[-1][4] is offsets and fake_op.calls[-1][5] is out
    out = gemm.k_grouped_fp8_gemm(**args)  # sizes: G = 3 entries
    assert out.shape == (3, 64, 128) and fake_op.calls[-1][5] is out
    given = torch.empty(3, 64, 128)
    assert gemm.k_grouped_fp8_gemm(**args, out=given, num_groups=3) is given and fake_op.calls[-1][5] is given
    assert len(fake_op.calls) == 3
    # num_groups that disagrees with out, or is not >= 1: the op is not tried, the Python path explains
    with pytest.raises(ValueError, match="out holds G=3 groups but num_groups=2"):
        gemm.k_grouped_fp8_gemm(**args, out=given, num_groups=2)
    with pytest.raises(ValueError, match="num_groups must be >= 1, got 0"):
        gemm.k_grouped_fp8_gemm(**args, num_groups=0)
    assert len(fake_op.calls) == 3


def test_k_grouped_refused_input_gets_the_layout_error(fake_op):
    fake_op.refuse = True
    args = _k_args()
    with pytest.raises(ValueError, match=r"inconsistent wgrad operands"):
        gemm.k_grouped_fp8_gemm(**{**args, "dy_t": args["dy_t"][:, :160], "x_t": args["x_t"][:, :160]})
    with pytest.raises(ValueError, match=r"offsets \[G\+1\] need num_groups=G or out"):
        gemm.k_grouped_fp8_gemm(**{**args, "groups": torch.tensor([0, 100, 100, 160])})
    # a refusal the Python checks do not explain (here on the CPU: the reference backend) still gives a result
    assert torch.equal(gemm.k_grouped_fp8_gemm(**args), R.k_grouped_fp8_gemm(*args.values()))
    assert len(fake_op.calls) == 3
