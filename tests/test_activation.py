"""megatron_tma.activation on the CPU: the reference path's numerics against float64 autograd, the fixed-order probs
gradient, and the API's errors. The CUDA kernel's tests are in test_activation_gpu.py."""
import pytest
import torch
from _activation64 import act64

from megatron_tma.activation import ACTIVATIONS, GATED, activation_times_probs


def inputs(t, f, activation, gen, probs_dtype=torch.float32):
    w = 2 * f if activation in GATED else f
    h = (torch.randn(t, w, generator=gen) * 2).bfloat16()
    p = torch.rand(t, generator=gen).to(probs_dtype)
    dz = torch.randn(t, f, generator=gen).bfloat16()
    return h, p, dz


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_reference_matches_float64_autograd(gen, activation, with_probs):
    h, p, dz = inputs(37, 48, activation, gen)
    h.requires_grad_()
    p = p.requires_grad_() if with_probs else None
    z = activation_times_probs(h, p, activation, backend="reference")
    z.backward(dz)
    h64 = h.detach().double().requires_grad_()
    p64 = p.detach().double().requires_grad_() if with_probs else None
    z64 = act64(h64, activation) * (p64[:, None] if with_probs else 1.0)
    z64.backward(dz.double())
    # one rounding to bf16 of an FP32 result: within 2^-8 relative (plus FP32 noise near 0)
    assert z.dtype == torch.bfloat16
    assert ((z.double() - z64.detach()).abs() <= 2**-8 * z64.detach().abs() + 1e-6).all()
    assert ((h.grad.double() - h64.grad).abs() <= 2**-8 * h64.grad.abs() + 1e-6).all()
    if with_probs:
        assert torch.allclose(p.grad.double(), p64.grad, rtol=1e-5, atol=1e-5)


def test_probs_gradient_keeps_the_probs_dtype(gen):
    h, p, dz = inputs(5, 16, "swiglu", gen, torch.bfloat16)
    p.requires_grad_()
    activation_times_probs(h, p, "swiglu").backward(dz)
    assert p.grad.dtype == torch.bfloat16


def test_nan_input_propagates(gen):
    """NaN in h gives NaN in its own outputs only (squared ReLU too: relu keeps NaN)."""
    for activation in ACTIVATIONS:
        h, p, _ = inputs(4, 16, activation, gen)
        h[1, 3] = float("nan")
        z = activation_times_probs(h, p, activation)
        assert z[1, 3].isnan() and not z[0].isnan().any() and not z[2:].isnan().any()


def test_errors(gen):
    h, p, _ = inputs(4, 16, "swiglu", gen)
    with pytest.raises(ValueError, match="activation must be one of swiglu, gelu, squared_relu"):
        activation_times_probs(h, p, "relu")
    with pytest.raises(ValueError, match="swiglu needs h = \\[gate \\| up\\] with an even width"):
        activation_times_probs(h[:, :31], p, "swiglu")
    with pytest.raises(ValueError, match="h must have at least one column"):
        activation_times_probs(h[:, :0], p, "gelu")
    with pytest.raises(ValueError, match="h must be a 2-D tensor"):
        activation_times_probs(h[0], p, "gelu")
    with pytest.raises(ValueError, match="probs must be \\[T\\] = \\[4\\]"):
        activation_times_probs(h, p[:3], "gelu")
    with pytest.raises(ValueError, match="backend must be 'auto', 'cuda' or 'reference'"):
        activation_times_probs(h, p, "gelu", backend="triton")
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        activation_times_probs(h, p, "gelu", backend="cuda")


def test_no_double_backward(gen):
    """A backward with create_graph=True is refused at once (issue 55 item 2): before, the gradient came back
    detached when dz did not require grad, and a penalty built on it contributed nothing."""
    h, p, dz = inputs(3, 16, "gelu", gen)
    h.requires_grad_()
    z = activation_times_probs(h, p, "gelu")
    with pytest.raises(RuntimeError, match="activation_times_probs is not twice differentiable"):
        torch.autograd.grad(z, h, dz, create_graph=True)
