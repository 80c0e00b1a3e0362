"""The activation recomputed in backward (`GroupedFP8MLP(recompute_activation=True)`, megatron_tma.activation_linear)
on the CPU (reference backend): the same bits as the two-Function path in every gradient, and less kept for
backward, by exactly the FP8 columns of the activation's output. The kernels: tests/test_mlp_gpu.py."""
import pytest
import torch

from megatron_tma import reference as R
from megatron_tma.activation import activation_times_probs
from megatron_tma.activation_linear import fp8_activation_grouped_linear
from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.mlp import ACTIVATIONS, GroupedFP8MLP

G, H, FFN = 4, 256, 128


def _pair(activation="swiglu", pad_to=None):
    """(the MLP, the same MLP with the activation recomputed), same weights."""
    torch.manual_seed(0)
    plain = GroupedFP8MLP(G, H, FFN, activation, pad_to=pad_to, backend="reference")
    recomputing = GroupedFP8MLP(G, H, FFN, activation, pad_to=pad_to, backend="reference", recompute_activation=True)
    recomputing.load_state_dict(plain.state_dict())
    return plain, recomputing


def _step(module, x, sizes, p, dy):
    """Forward + backward on fresh leaves: (out, dx, dprobs, *fc1 grads, *fc2 grads)."""
    x = x.detach().clone().requires_grad_()
    p = None if p is None else p.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, _ = module(x, sizes, p)
    out.backward(dy)
    return (out.detach(), x.grad, None if p is None else p.grad, *module.linear_fc1.expert_grads(),
            *module.linear_fc2.expert_grads())


def _inputs(gen, sizes, probs=True):
    t = sum(sizes)
    x = torch.randn(t, H, generator=gen).bfloat16()
    p = torch.rand(t, generator=gen) if probs else None
    return x, torch.tensor(sizes), p, torch.randn(t, H, generator=gen).bfloat16()


def _assert_equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None and v is None) or torch.equal(u, v), f"result {i} differs"


@pytest.mark.parametrize("pad_to", [None, 16])
@pytest.mark.parametrize("activation,probs", [(a, True) for a in ACTIVATIONS] + [("swiglu", False)])
def test_same_bits_as_keeping_the_activation(one_thread, gen, activation, probs, pad_to):
    plain, recomputing = _pair(activation, pad_to)
    # empty groups, a single row, one short of and one past a 128-token block (the columns' partial blocks)
    x, sizes, p, dy = _inputs(gen, [0, 1, 127, 129], probs)
    _assert_equal(_step(plain, x, sizes, p, dy), _step(recomputing, x, sizes, p, dy))


def test_unpadded_equals_padded_twin_when_recomputing(one_thread, gen):
    _, ours = _pair()
    _, twin = _pair(pad_to=128)
    x, sizes, p, dy = _inputs(gen, [130, 0, 3, 200])
    _assert_equal(_step(ours, x, sizes, p, dy), _step(twin, x, sizes, p, dy))


def test_groups_as_offsets(one_thread, gen):
    """Offsets [G+1] through the recomputing Function: fc2's weight gradient is told G (the columns' quantizer and the
    K-grouped GEMM), so the bits are those of the sizes."""
    _, sizes, _, dy = _inputs(gen, [0, 17, 129, 15])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).int()
    torch.manual_seed(1)
    w = (0.05 * torch.randn(G, H, FFN)).bfloat16()
    h = torch.randn(sum([0, 17, 129, 15]), 2 * FFN, generator=gen).bfloat16()
    grads = []
    for groups in (sizes, offsets):
        weight = w.clone().requires_grad_()
        fp8_activation_grouped_linear(h, None, "swiglu", weight, groups, backend="reference").backward(dy)
        grads.append(weight.grad)
    assert torch.equal(*grads)


def _saved_bytes(module, x, sizes, p):
    """Bytes the forward keeps for backward (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, p = x.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = module(x, sizes, p)
    del out
    return sum(seen.values())


def test_keeps_less_by_exactly_the_activation_columns(gen):
    plain, recomputing = _pair()
    sizes = [300, 0, 129, 77]
    x, sizes_t, p, _ = _inputs(gen, sizes)
    z = torch.zeros(sum(sizes), FFN, dtype=torch.bfloat16)
    zt, zt_s = R.quantize_grouped_128x1(z, sizes_t)  # what fc2 keeps for its weight gradient without recomputing
    saved, saved_recomputing = _saved_bytes(plain, x, sizes_t, p), _saved_bytes(recomputing, x, sizes_t, p)
    assert saved - saved_recomputing == zt.untyped_storage().nbytes() + zt_s.untyped_storage().nbytes()


def test_main_grad_accumulation_is_the_same(one_thread, gen):
    results = []
    x, sizes, p, dy = _inputs(gen, [64, 200, 0, 5])
    for module in _pair():
        for w in module.parameters():
            w.main_grad = torch.full(w.shape, 0.25)
            w.grad_added_to_main_grad = False
        _step(module, x, sizes, p, dy)
        assert all(w.grad is not None and w.grad_added_to_main_grad for w in module.parameters())  # DDP's dummy
        results.append([w.main_grad for w in module.parameters()])
    _assert_equal(*results)


def _two_step(h, probs, w, sizes):
    return fp8_grouped_linear(activation_times_probs(h, probs, "swiglu", "reference"), w, sizes, backend="reference")


@pytest.mark.parametrize("wants", ["weights", "inputs", "h"])
def test_partial_gradients(one_thread, gen, wants):
    """Only the weights (no dz, so no activation backward), only h and the probs (no recomputation), only h."""
    h = torch.randn(300, 2 * FFN, generator=gen).bfloat16()
    probs = torch.rand(300, generator=gen)
    w = (0.05 * torch.randn(G, H, FFN, generator=gen)).bfloat16()
    sizes, dy = torch.tensor([100, 0, 150, 50]), torch.randn(300, H, generator=gen).bfloat16()
    grads = []
    for fn in (_two_step, lambda *a: fp8_activation_grouped_linear(*a[:2], "swiglu", *a[2:], backend="reference")):
        hh, pp, ww = h.clone(), probs.clone(), w.clone()
        hh.requires_grad_(wants != "weights")
        pp.requires_grad_(wants == "inputs")
        ww.requires_grad_(wants == "weights")
        y = fn(hh, pp, ww, sizes)
        y.backward(dy)
        grads.append((y.detach(), hh.grad, pp.grad, ww.grad))
    _assert_equal(*grads)
    assert (grads[0][3] is not None) == (wants == "weights") and (grads[0][1] is not None) == (wants != "weights")


def test_inference_and_validation(gen):
    h = torch.randn(10, 2 * FFN, generator=gen).bfloat16()
    w = (0.05 * torch.randn(G, H, FFN, generator=gen)).bfloat16()
    sizes = torch.tensor([4, 0, 6, 0])
    with torch.no_grad():
        y = fp8_activation_grouped_linear(h, None, "swiglu", w, sizes, backend="reference")
        assert torch.equal(y, _two_step(h, None, w, sizes))
    with pytest.raises(ValueError, match=r"act\(h\) is \[M, K\] = \[10, 256\] but the weights are \[N, K\]"):
        fp8_activation_grouped_linear(h, None, "gelu", w, sizes, backend="reference")  # gelu: act(h) is [10, 256]
    with pytest.raises(ValueError, match="activation must be one of"):
        fp8_activation_grouped_linear(h, None, "relu", w, sizes)
    with pytest.raises(TypeError, match="act\\(h\\) must have dtype bfloat16"):
        fp8_activation_grouped_linear(h.float(), None, "swiglu", w, sizes)
    with pytest.raises(TypeError, match="recompute_activation must be a bool"):
        GroupedFP8MLP(G, H, FFN, recompute_activation="yes")
    assert "recompute_activation=True" in repr(_pair()[1])


def test_both_linears_run_through_their_module_call(gen):
    """Megatron's distributed optimizer waits for a module's parameter all-gather in that module's forward pre-hook
    (overlap_param_gather): fc2 must be called as a module when it recomputes its input too, or its weights would
    be quantized before they arrive."""
    _, recomputing = _pair()
    calls = []
    for name in ("linear_fc1", "linear_fc2"):
        getattr(recomputing, name).register_forward_pre_hook(lambda module, args, name=name: calls.append(name))
    x, sizes, p, dy = _inputs(gen, [5, 0, 130, 1])
    _step(recomputing, x, sizes, p, dy)
    assert calls == ["linear_fc1", "linear_fc2"]


def test_a_strided_h_reaches_the_quantizers_contiguous(gen, quantizer_preconditions):
    """h as a transposed view: the activation's torch path keeps that layout, and the quantizers (whose GPU ops refuse
    a strided input) get act(h) contiguous, in the forward and in the backward's recomputation."""
    h = torch.randn(256, 200, generator=gen).bfloat16().t().requires_grad_()
    w = (torch.randn(2, 128, 128, generator=gen) * 0.05).bfloat16().requires_grad_()
    sizes = torch.tensor([120, 80])
    y = fp8_activation_grouped_linear(h, None, "swiglu", w, sizes, backend="reference")
    y.backward(torch.randn(200, 128, generator=gen).bfloat16())
    assert h.grad is not None and w.grad is not None
    assert {name for name, _ in quantizer_preconditions} >= {"run_1x128_and_grouped_128x1", "run_grouped_128x1"}

