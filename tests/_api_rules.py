"""Shared by tests/test_argument_errors.py (CPU) and tests/test_api_rules_gpu.py (CUDA): arguments that were taken for
something else (issue 55 item 7), each refused in one line naming the argument and the rule, the same on both
backends."""
import pytest
import torch

from megatron_tma import permutation as P
from megatron_tma import reference as R
from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm
from megatron_tma.mlp import GroupedFP8MLP


def one_line(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, text


def k_args(device):
    """The wgrad operands of 160 tokens in 3 groups (sizes [100, 0, 60]) on `device`."""
    gen = torch.Generator().manual_seed(4)
    sizes = torch.tensor([100, 0, 60])
    xt, xs = R.quantize_grouped_128x1(torch.randn(160, 128, generator=gen).bfloat16(), sizes)
    dyt, dys = R.quantize_grouped_128x1(torch.randn(160, 64, generator=gen).bfloat16(), sizes)
    return {name: t.to(device) for name, t in dict(dy_t=dyt, dy_t_scales=dys, x_t=xt, x_t_scales=xs,
                                                   groups=sizes).items()}


def small_permutation(device):
    """A Permutation of 3 tokens, top-1 of 2 experts."""
    routing_map = torch.tensor([[1, 0], [0, 1], [1, 0]], dtype=torch.bool, device=device)
    return P.permutation_from_routing_map(routing_map, 1)[0]


ACCUMULATE_NOT_BOOL = ["no", "", 1, 0, None, torch.tensor(True)]


def check_accumulate_must_be_a_bool(accumulate, device, backend):
    out = torch.zeros(3, 64, 128, device=device)
    with pytest.raises(TypeError) as e:
        k_grouped_fp8_gemm(**k_args(device), out=out, accumulate=accumulate, backend=backend)
    one_line(e, "accumulate must be a bool", type(accumulate).__name__)
    assert not out.any()  # refused before any work


def check_out_with_another_group_count(g_out, device, backend):
    with pytest.raises(ValueError) as e:
        k_grouped_fp8_gemm(**k_args(device), out=torch.zeros(g_out, 64, 128, device=device), backend=backend)
    if g_out == 2:
        one_line(e, "groups (3 entries, read as offsets [G+1] since out holds G=2 groups): offsets must start at 0")
    else:
        one_line(e, "groups (out holds G=4 groups) has 3 entries: expected G sizes or G+1 offsets with G=4")


def check_b_with_another_group_count(device, backend):
    gen = torch.Generator().manual_seed(3)
    aq, a_s = R.quantize_1x128(torch.randn(200, 256, generator=gen).bfloat16().to(device))
    b, bs, _, _ = R.quantize_128x128((torch.randn(2, 128, 256, generator=gen) * 0.05).bfloat16().to(device))
    with pytest.raises(ValueError) as e:
        m_grouped_fp8_gemm(aq, a_s, b, bs, torch.tensor([100, 0, 100], device=device), backend=backend)
    one_line(e, "groups (3 entries, read as offsets [G+1] since b holds G=2 groups): offsets must start at 0, got "
                "offsets[0]=100")


PERMUTATION_LOOKALIKES = ["tuple", "list", "tensor"]


def check_permutation_lookalike(op, form, device, backend):
    perm = small_permutation(device)
    lookalike = {"tuple": (perm.rows, perm.token_rows), "list": [perm.rows, perm.token_rows], "tensor": perm.rows}
    x = torch.randn(3, 8).bfloat16().to(device)
    with pytest.raises(TypeError) as e:
        getattr(P, op)(x, lookalike[form], backend=backend)
    one_line(e, "permutation must be a megatron_tma.permutation.Permutation", type(lookalike[form]).__name__)


def _bogus_backend_calls(device):
    perm = small_permutation(device)
    x = torch.randn(3, 8).bfloat16().to(device).requires_grad_()
    aq, a_s = R.quantize_1x128(torch.randn(0, 128).bfloat16().to(device))
    b, bs, _, _ = R.quantize_128x128(torch.randn(2, 128, 128).bfloat16().to(device))
    return {
        "gather_rows": lambda: P.gather_rows(x, perm, backend="bogus"),  # (accepted until its backward)
        "combine_rows": lambda: P.combine_rows(x.detach(), perm, backend="bogus"),
        "m_grouped_fp8_gemm-no-rows": lambda: m_grouped_fp8_gemm(aq, a_s, b, bs, torch.tensor([0, 0], device=device),
                                                                 backend="bogus"),
        "k_grouped_fp8_gemm": lambda: k_grouped_fp8_gemm(**k_args(device), backend="bogus"),
        "fp8_grouped_linear": lambda: fp8_grouped_linear(torch.randn(4, 128).bfloat16().to(device), torch.randn(
            2, 128, 128).bfloat16().to(device), torch.tensor([2, 2], device=device), backend="bogus"),
        "GroupedFP8MLP": lambda: GroupedFP8MLP(2, 128, 128, backend="bogus", device=device),
        "not-a-str": lambda: P.combine_rows(x.detach(), perm, backend=["cuda"]),
    }


BOGUS_BACKEND_CALLS = sorted(_bogus_backend_calls("cpu"))


def check_bogus_backend(name, device):
    call = _bogus_backend_calls(device)[name]
    with pytest.raises(ValueError) as e:
        call()
    one_line(e, "backend must be 'auto', 'cuda' or 'reference', got")
