"""The expert MLP's step as one autograd Function: `fc2(act(fc1(x)) * probs)`, forward and backward, with every check
made once per call by the module (megatron_tma.mlp.GroupedFP8MLP) and nothing per kernel but the kernel's own op.

Why: the eager layer step is host-bound on fine-grained experts (Qwen3-30B-A3B's 128 experts of FFN 768: the GPU
work of a step is shorter than the host time to enqueue it). Composed of its parts, the step runs three autograd
Functions (fc1, the activation, fc2), each with its own argument rules, group check and weight look-up; here the
module's one check of its inputs stands for all of them, and one Function runs the same kernels in the same order
with the same arguments. So the bits are the composed path's (tests/test_mlp_function.py compares both with
`torch.equal`, forward, input, probs and weight gradients, `main_grad` accumulation, the permutation), and so are the
padded twin's.

    forward:  [gather +] quantize x (1x128 rows; per-group 128x1 columns if fc1's weights want a gradient)
              h = M-grouped(x, W1)               z = act(h) * probs
              quantize z (rows; columns if fc2's weights want a gradient)
              y = M-grouped(z, W2)               [combine the rows per token]
    backward: fc2's (megatron_tma.autograd.linear_backward: dY quantized once, dgrad, wgrad into main_grad or .grad)
              dh, dprobs = the activation's backward
              fc1's (the same), [combine dx per token]

Saved for backward: X's and z's FP8 columns, h (BF16), the probs, the W^T copies (or W's, when the layer makes W^T in
backward), the group tensor and the permutation: what the composed Functions save, nothing more.

What the module hands over (`MlpPlan`) is checked by the module; this file checks nothing again.
"""
from typing import NamedTuple, Optional, Sequence

import torch

from . import gemm, quant
from . import permutation as _permutation
from ._validate import not_twice_differentiable
from .activation import act_times_probs_backward, act_times_probs_forward
from .autograd import QuantizedWeights, linear_backward, transposed_weights
from .groups import Groups
from .wgrad_deferral import WgradDeferral

__all__ = ["MlpPlan", "fp8_expert_mlp"]


class MlpPlan(NamedTuple):
    """Everything of one MLP call that is not a differentiable input: checked by the module, read here as is."""

    groups: Groups  # the expert rows' checked groups
    fc1: QuantizedWeights  # W1's FP8 copies (qt, st None: backward transposes q, s)
    fc2: QuantizedWeights
    activation: str
    use_kernel: bool  # the activation's op (its device's kernel) rather than the reference directly
    backend: str
    pow2: bool
    rows: Optional[torch.Tensor]  # a Permutation's rows: x is the tokens, the expert rows are x[rows]
    token_rows: Optional[torch.Tensor]  # ... and its token_rows: the output and dx are combined per token
    deferral1: Optional[WgradDeferral]  # fc1's, fc2's weight-gradient deferral (megatron_tma.wgrad_deferral)
    deferral2: Optional[WgradDeferral]
    num_fc1_weights: int  # how many of the Function's weights are fc1's (1 stacked, or G)


def _quantize_input(x, plan: MlpPlan, need_columns: bool):
    """x's rows (or the gathered rows x[rows]) quantized 1x128, with the per-group columns when wgrad reads them."""
    groups, pow2, backend = plan.groups, plan.pow2, plan.backend
    if need_columns:
        if plan.rows is None:
            return quant.run_1x128_and_grouped_128x1(x, groups, pow2, backend)
        return quant.run_gather_1x128_and_grouped_128x1(x, plan.rows, groups, pow2, backend)
    xq, xs = quant.run_1x128(x if plan.rows is None else x.index_select(0, plan.rows), pow2, backend)
    return xq, xs, None, None


def _forward(x, probs, plan: MlpPlan, need_dw1: bool, need_dw2: bool):
    """(y, what backward reads: X's columns, h, z's columns)."""
    xq, xs, xt, xt_s = _quantize_input(x, plan, need_dw1)
    h = gemm.run_m_grouped(xq, xs, plan.fc1.q, plan.fc1.s, plan.groups, backend=plan.backend)
    del xq, xs
    z = act_times_probs_forward(h, probs, plan.activation, plan.use_kernel)
    if need_dw2:
        zq, zs, zt, zt_s = quant.run_1x128_and_grouped_128x1(z, plan.groups, plan.pow2, plan.backend)
    else:
        (zq, zs), zt, zt_s = quant.run_1x128(z, plan.pow2, plan.backend), None, None
    del z
    y = gemm.run_m_grouped(zq, zs, plan.fc2.q, plan.fc2.s, plan.groups, backend=plan.backend)
    if plan.token_rows is not None:
        y = _permutation.run_combine_rows(y, plan.token_rows, plan.backend)
    return y, xt, xt_s, h, zt, zt_s


class _FP8ExpertMLP(torch.autograd.Function):
    """y = fc2(act(fc1(x)) * probs); inputs (x, probs, plan, *fc1's weights, *fc2's weights): the weights only route
    their gradients (the GEMMs read the plan's FP8 copies)."""

    @staticmethod
    def forward(ctx, x, probs, plan: MlpPlan, *weights):
        n1 = plan.num_fc1_weights
        needs = ctx.needs_input_grad
        need_dx, need_dprobs = needs[0], needs[1]
        need_dw1, need_dw2 = any(needs[3:3 + n1]), any(needs[3 + n1:])
        need_dh = need_dx or need_dw1  # h's gradient feeds x's and W1's
        need_dz = need_dh or need_dprobs
        y, xt, xt_s, h, zt, zt_s = _forward(x, probs, plan, need_dw1, need_dw2)
        fc1, ctx.transpose_fc1 = _dgrad_operands(plan.fc1, need_dx)
        fc2, ctx.transpose_fc2 = _dgrad_operands(plan.fc2, need_dz)
        # the tensors go through save_for_backward; the rest of the plan stays on ctx
        ctx.plan = plan._replace(groups=None, fc1=None, fc2=None, rows=None, token_rows=None)
        ctx.groups_meta, ctx.needs = plan.groups[1:], (need_dx, need_dprobs, need_dh, need_dz)
        ctx.save_for_backward(plan.groups.tensor, xt, xt_s, h if need_dz else None, probs if need_dz else None, zt,
                              zt_s, *fc1, *fc2, plan.rows, plan.token_rows if need_dx else None, *weights)
        return y

    @staticmethod
    @not_twice_differentiable("GroupedFP8MLP")
    def backward(ctx, dy):
        groups, xt, xt_s, h, probs, zt, zt_s, q1, s1, q2, s2, rows, token_rows, *weights = ctx.saved_tensors
        plan = ctx.plan
        groups = Groups(groups, *ctx.groups_meta)
        need_dx, need_dprobs, need_dh, need_dz = ctx.needs
        n1 = plan.num_fc1_weights
        needs_w = ctx.needs_input_grad[3:]
        if ctx.transpose_fc2:
            q2, s2 = transposed_weights(q2, s2)
        dz, wgrads2 = linear_backward(dy, groups, zt, zt_s, q2, s2, weights[n1:], need_dz, needs_w[n1:], plan.backend,
                                      plan.pow2, dy_rows=rows, deferral=plan.deferral2)
        del zt, zt_s, q2, s2
        dx = dprobs = None
        wgrads1 = [None] * n1
        if dz is not None:
            dh, dprobs = act_times_probs_backward(dz, h, probs, plan.activation, plan.use_kernel, need_dh, need_dprobs)
            del dz, h
            if dh is not None:
                if ctx.transpose_fc1:
                    q1, s1 = transposed_weights(q1, s1)
                dx, wgrads1 = linear_backward(dh, groups, xt, xt_s, q1, s1, weights[:n1], need_dx, needs_w[:n1],
                                              plan.backend, plan.pow2, deferral=plan.deferral1)
                if dx is not None and token_rows is not None:
                    dx = _permutation.run_combine_rows(dx, token_rows, plan.backend)
        return (dx, dprobs, None) + tuple(wgrads1) + tuple(wgrads2)


def _dgrad_operands(wq: QuantizedWeights, need: bool):
    """((qt, st) to save for dgrad, or (q, s) when W^T is not kept, or (None, None) when no gradient needs it; whether
    backward transposes them), as megatron_tma.autograd.dgrad_operands."""
    if not need:
        return (None, None), False
    return ((wq.q, wq.s), True) if wq.qt is None else ((wq.qt, wq.st), False)


def fp8_expert_mlp(x: torch.Tensor, probs: Optional[torch.Tensor], plan: MlpPlan, fc1_weights: Sequence[torch.Tensor],
                   fc2_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The MLP's output (module docstring); `plan` as the module checked it. Inference (no gradient wanted or grad
    mode off) runs the same forward and keeps nothing."""
    wants_grad = (x.requires_grad or (probs is not None and probs.requires_grad)
                  or any(w.requires_grad for w in fc1_weights) or any(w.requires_grad for w in fc2_weights))
    if not torch.is_grad_enabled() or not wants_grad:
        return _forward(x, probs, plan, False, False)[0]
    return _FP8ExpertMLP.apply(x, probs, plan, *fc1_weights, *fc2_weights)
