"""Shared by the double-backward tests (CPU and GPU, issue 55 item 2): the package's differentiable entry points with
inputs that want gradients, and the checks that a backward with create_graph=True through an FP8 linear is refused
(its backward is FP8 GEMMs on quantized copies and builds no graph: the gradient came back detached, so a gradient
penalty on it contributed nothing, silently) while the permutation's gather and combine are differentiable twice."""
import pytest
import torch

from megatron_tma.activation import activation_times_probs
from megatron_tma.activation_linear import fp8_activation_grouped_linear
from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.permutation import combine_rows, gather_rows, permutation_from_routing_map

SIZES = (40, 0, 23)
K = N = 128


def _rows(m, k, gen, device):
    return torch.randn(m, k, generator=gen).bfloat16().to(device)


def _routing(tokens, experts, topk, gen, device):
    chosen = torch.randn(tokens, experts, generator=gen).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    return permutation_from_routing_map(routing_map.to(device), topk)


def _weights(gen, device, g=len(SIZES), n=N, k=K):
    return torch.nn.Parameter((torch.randn(g, n, k, generator=gen) * 0.05).bfloat16().to(device))


def _linear(gen, device, backend):
    x = _rows(sum(SIZES), K, gen, device).requires_grad_()
    w = _weights(gen, device)
    return fp8_grouped_linear(x, w, torch.tensor(SIZES, device=device), backend=backend), (x, w)


def _linear_permutation(gen, device, backend):
    perm, sizes, _ = _routing(21, 3, 2, gen, device)
    x = _rows(21, K, gen, device).requires_grad_()
    w = _weights(gen, device)
    return fp8_grouped_linear(x, w, sizes, permutation=perm, combine=perm, backend=backend), (x, w)


def _activation_linear(gen, device, backend):
    h = _rows(sum(SIZES), 2 * K, gen, device).requires_grad_()
    probs = torch.rand(sum(SIZES), generator=gen).to(device).requires_grad_()
    w = _weights(gen, device)
    y = fp8_activation_grouped_linear(h, probs, "swiglu", w, torch.tensor(SIZES, device=device), backend=backend)
    return y, (h, probs, w)


def _activation(gen, device, backend):
    h = _rows(sum(SIZES), 2 * K, gen, device).requires_grad_()
    probs = torch.rand(sum(SIZES), generator=gen).to(device).requires_grad_()
    return activation_times_probs(h, probs, "swiglu", backend=backend), (h, probs)


def _mlp(gen, device, backend, **kw):
    torch.manual_seed(0)
    mlp = GroupedFP8MLP(len(SIZES), K, N, backend=backend, device=device, **kw)
    x = _rows(sum(SIZES), K, gen, device).requires_grad_()
    out, _ = mlp(x, torch.tensor(SIZES, device=device))
    return out, (x,) + tuple(mlp.parameters())


CASES = {
    "fp8_grouped_linear": (_linear, "fp8_grouped_linear"),
    "fp8_grouped_linear-permutation": (_linear_permutation, "fp8_grouped_linear"),
    "fp8_activation_grouped_linear": (_activation_linear, "fp8_activation_grouped_linear"),
    "activation_times_probs": (_activation, "activation_times_probs"),
    "mlp": (_mlp, "fp8_grouped_linear"),
    "mlp-recompute": (lambda g, d, b: _mlp(g, d, b, recompute_activation=True), "fp8_activation_grouped_linear"),
    "mlp-padded": (lambda g, d, b: _mlp(g, d, b, pad_to=16), "not twice differentiable"),
}

# How a user asks for a differentiable gradient: the incoming gradient plain (y.sum(), where once_differentiable let
# the gradient come back detached) or itself wanting a gradient, through torch.autograd.grad or backward.
WAYS = ("grad-of-sum", "grad-with-a-differentiable-dy", "backward-create-graph")


def check_double_backward_is_refused(case, way, gen, device, backend):
    make, name = CASES[case]
    y, inputs = make(gen, device, backend)
    with pytest.raises(RuntimeError) as e:
        if way == "grad-of-sum":
            torch.autograd.grad(y.float().sum(), inputs, create_graph=True, allow_unused=True)
        elif way == "grad-with-a-differentiable-dy":
            dy = torch.ones_like(y, requires_grad=True)
            torch.autograd.grad(y, inputs, dy, create_graph=True, allow_unused=True)
        else:
            y.float().sum().backward(create_graph=True)
    text = str(e.value)
    assert "\n" not in text and name in text and "not twice differentiable" in text, text
    # A plain backward still runs.
    y, inputs = make(gen, device, backend)
    torch.autograd.grad(y.float().sum(), inputs, allow_unused=True)


def check_gather_and_combine_twice(gen, device, backend):
    """The gradient of a gather is a combine and vice versa, each differentiable again: a penalty on the first
    gradient reaches the weights that made it, with the bits of the other op."""
    perm, _, _ = _routing(20, 6, 3, gen, device)
    x = _rows(20, 32, gen, device).requires_grad_()
    w = _rows(60, 32, gen, device).requires_grad_()
    (gx,) = torch.autograd.grad((gather_rows(x, perm, backend=backend) * w).sum(), x, create_graph=True)
    assert gx.requires_grad
    assert torch.equal(gx, combine_rows(w.detach(), perm, backend=backend))
    gx.float().pow(2).sum().backward()
    assert torch.equal(w.grad, (2 * gx.detach().float()).bfloat16().index_select(0, perm.rows.long()))

    y = _rows(60, 32, gen, device).requires_grad_()
    v = _rows(20, 32, gen, device).requires_grad_()
    (gy,) = torch.autograd.grad((combine_rows(y, perm, backend=backend) * v).sum(), y, create_graph=True)
    assert gy.requires_grad and torch.equal(gy, v.detach().index_select(0, perm.rows.long()))
    gy.float().pow(2).sum().backward()
    assert torch.equal(v.grad, combine_rows((2 * gy.detach().float()).bfloat16(), perm, backend=backend))
