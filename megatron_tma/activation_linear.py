"""`fc2(act(h) * probs)` as one autograd Function that keeps h and not the activation's output: Megatron's
`recompute_modules=["moe_act"]` for the FP8 expert MLP (`GroupedFP8MLP(recompute_activation=True)`).

The MLP otherwise keeps two things for the backward of its second half: h (BF16 `[T, 2F]` for SwiGLU, `[T, F]`
otherwise), which the activation's backward reads, and the per-group FP8 columns of z = act(h) * probs (`[F, P]`
bytes, P = round_up(T, 128) + 128 G, plus scales), which fc2's weight gradient reads. Here the forward keeps h and the
probs only. The backward recomputes z with the same kernel (the same bits: every element comes from its own row of
h), quantizes its columns, runs fc2's backward and then the activation's. Saved: F bytes per routed token and 16 F
per expert (about 12% of the layer's saved activations at DeepSeek-V3's H = 7168, F = 2048). Paid: one activation
pass and one column quantization of z in backward (the forward quantizes z's rows only, instead of rows and columns
in one pass).
The results equal `activation_times_probs` followed by `fp8_grouped_linear` bit for bit
(tests/test_activation_linear.py on the reference backend, tests/test_mlp_gpu.py on the kernels), so the padded twin
stays the oracle.
"""
from typing import Optional

import torch

from . import quant
from ._validate import check_same_device, not_twice_differentiable
from .activation import (GATED, act_times_probs_backward, act_times_probs_forward, check_activation_args,
                         resolve_kernel)
from ._validate import check_bool
from .autograd import (FP8WeightCache, Weights, check_linear_args, dgrad_operands, linear_backward,
                       linear_forward, quantized_weights)
from .groups import Groups
from .wgrad_deferral import WgradDeferral

__all__ = ["fp8_activation_grouped_linear"]

# Positions in forward's inputs (h, probs, groups, q, s, qt, st, activation, use_kernel, backend, pow2, deferral,
# *weights).
_H, _PROBS, _WEIGHTS = 0, 1, 12


def _z(h, probs, activation, use_kernel):
    """act(h) * probs as the quantizers read it: contiguous (the torch path keeps a strided h's layout)."""
    return act_times_probs_forward(h, probs, activation, use_kernel).contiguous()


class _FP8ActivationGroupedLinear(torch.autograd.Function):
    """y = grouped(act(h) * probs . W^T), saving h and the probs; see the module docstring."""

    @staticmethod
    def forward(ctx, h, probs, groups, q, s, qt, st, activation, use_kernel, backend, pow2, deferral, *weights):
        need_dz = ctx.needs_input_grad[_H] or ctx.needs_input_grad[_PROBS]
        y = linear_forward(_z(h, probs, activation, use_kernel), groups, q, s, backend, pow2)
        ctx.activation, ctx.use_kernel, ctx.backend, ctx.pow2 = activation, use_kernel, backend, pow2
        ctx.groups_meta, ctx.need_dw = groups[1:], any(ctx.needs_input_grad[_WEIGHTS:])
        ctx.deferral = deferral
        ctx.save_for_backward(h, probs, groups.tensor, *dgrad_operands(ctx, q, s, qt, st, need_dz), *weights)
        return y

    @staticmethod
    @not_twice_differentiable("fp8_activation_grouped_linear")
    def backward(ctx, dy):
        h, probs, groups, qt, st, *weights = ctx.saved_tensors
        groups = Groups(groups, *ctx.groups_meta)
        need_dh, need_dprobs = ctx.needs_input_grad[_H], ctx.needs_input_grad[_PROBS]
        zt = zt_s = None
        if ctx.need_dw:  # the recomputation: z again, then the columns fc2's weight gradient reads
            z = _z(h, probs, ctx.activation, ctx.use_kernel)
            zt, zt_s = quant.run_grouped_128x1(z, groups, ctx.pow2, ctx.backend)
            del z
        dz, wgrads = linear_backward(dy, groups, zt, zt_s, (qt, st), weights, need_dh or need_dprobs,
                                     ctx.needs_input_grad[_WEIGHTS:], ctx.backend, ctx.pow2, deferral=ctx.deferral,
                                     transpose_in_backward=ctx.transpose_in_backward)
        del zt, zt_s
        dh = dprobs = None
        if dz is not None:
            dh, dprobs = act_times_probs_backward(dz, h, probs, ctx.activation, ctx.use_kernel, need_dh, need_dprobs)
        return (dh, dprobs) + (None,) * (_WEIGHTS - 2) + tuple(wgrads)


def fp8_activation_grouped_linear(
    h: torch.Tensor,
    probs: Optional[torch.Tensor],
    activation: str,
    weight: Weights,
    groups: torch.Tensor,
    *,
    cache: Optional[FP8WeightCache] = None,
    backend: str = "auto",
    pow2_scales: bool = False,
    keep_transposed_weight: bool = True,
    wgrad_deferral: Optional[WgradDeferral] = None,
) -> torch.Tensor:
    """`fp8_grouped_linear(activation_times_probs(h, probs, activation), weight, groups)` with the activation
    recomputed in backward instead of its FP8 columns kept (module docstring). The arguments are those of the two
    functions; h: bf16 `[T, 2F]` (SwiGLU, gate half first) or `[T, F]`, weight `[G, N, F]` (or G `[N, F]`).
    Returns bf16 `[T, N]`, with gradients for h, the probs and the weights. keep_transposed_weight: as
    `fp8_grouped_linear`'s, and so is wgrad_deferral."""
    check_activation_args(h, probs, activation)
    f = h.shape[1] // 2 if activation in GATED else h.shape[1]
    weights, groups = check_linear_args(h[:, :f], weight, groups, backend, pow2_scales, x_name="act(h)",
                                        x_contiguous=False)
    if probs is not None:
        check_same_device(h=h, probs=probs)
    use_kernel = resolve_kernel(h, activation, backend)
    check_bool(keep_transposed_weight, "keep_transposed_weight")
    wq = quantized_weights(weights, cache, pow2_scales, backend, keep_transposed_weight)
    wants_grad = h.requires_grad or (probs is not None and probs.requires_grad) or any(w.requires_grad
                                                                                        for w in weights)
    if not torch.is_grad_enabled() or not wants_grad:  # inference: nothing to save
        z = _z(h, probs, activation, use_kernel)
        return linear_forward(z, groups, wq.q, wq.s, backend, pow2_scales)
    return _FP8ActivationGroupedLinear.apply(h, probs, groups, wq.q, wq.s, wq.qt, wq.st, activation, use_kernel,
                                             backend, pow2_scales, wgrad_deferral, *weights)
