"""`act(fc1(x)) * probs` as one autograd node: the expert MLP's first half (megatron_tma.mlp_function), whose backward
frees each of its tensors as soon as it is read.

Why one node: fc1's backward is where the layer's backward peaks once the weight gradients exist (all of them are
alive then, and dX is made). As two nodes (fc1's `_FP8GroupedLinear`, then `_ActivationTimesProbs`), the activation's
backward hands fc1's a BF16 dh (`[T, 2F]`, 4F bytes a routed row for SwiGLU) that autograd keeps until fc1's backward
returns, beside the FP8 rows and columns quantized from it; and x's FP8 columns, saved for backward, stay alive
through the dgrad GEMM. Here the backward owns both: dh is quantized and dropped before the weight-gradient GEMM
allocates its result, h (the activation's input, an intermediate of this node) is dropped once dh exists, and x's
columns once the weight gradient has read them. What autograd keeps instead is the incoming dz (`[T, F]`, 2F bytes a
row) until the node returns. Per routed row at fc1's GEMMs, SwiGLU / GeGLU (h and dh `[T, 2F]`): 6F + H bytes during
the weight gradient (dz, dh's rows and columns, x's columns) and 4F + 2H during the dgrad, against 8F + H and
6F + 3H as two nodes (plus the weight gradients, the same either way); for the one-input activations (h and dh
`[T, F]`) the weight-gradient phase holds what two nodes would and the dgrad phase H less. The activation's backward
itself (dz, h, dh and x's columns alive) is unchanged. A backward that wants the probs' gradient alone runs no fc1
GEMM, as with two nodes, where the engine never reached fc1's.

The kernels, their order and their arguments are those of the two nodes, so are the bits (tests/
test_mlp_function.py compares with `torch.equal`). h and x's columns are held on the node, not through
`save_for_backward` (which keeps them until the node is released), so saved-tensor hooks would not see them: under
active hooks (`torch.autograd.graph.saved_tensors_hooks`: activation offloading, a user's packing) the two nodes run
instead, everything saved the usual way. A backward through the node runs once: a second one (`retain_graph=True`)
raises (one backward captured with `retain_graph=True`, as Megatron's `cuda_graph_retain_backward_graph` does, is
one backward).
"""
import torch

from . import permutation as _permutation
from ._validate import not_twice_differentiable
from .activation import _ActivationTimesProbs, act_times_probs_backward, act_times_probs_forward
from .autograd import (checked_linear, dgrad, dgrad_operands, forward_keeping_columns, quantize_output_grad,
                       weight_grads)
from .groups import Groups

__all__ = ["linear_activation"]

# Positions in forward's inputs (x, probs, groups, q, s, qt, st, rows, token_rows, activation, use_kernel, backend,
# pow2, deferral, *weights).
_X, _PROBS, _WEIGHTS = 0, 1, 14


class _FP8GroupedLinearActivation(torch.autograd.Function):
    """z = act(grouped(x . W^T)) * probs; see the module docstring. `rows` / `token_rows` as `_FP8GroupedLinear`'s
    (x the routed tokens, the GEMM's rows `x[rows]`, x's gradient combined per token)."""

    @staticmethod
    def forward(ctx, x, probs, groups, q, s, qt, st, rows, token_rows, activation, use_kernel, backend, pow2, deferral,
                *weights):
        need_dx = ctx.needs_input_grad[_X]
        need_dw = any(ctx.needs_input_grad[_WEIGHTS:])
        h, xt, xt_s = forward_keeping_columns(x, groups, q, s, rows, need_dw, backend, pow2)
        z = act_times_probs_forward(h, probs, activation, use_kernel)
        ctx.activation, ctx.use_kernel, ctx.backend, ctx.pow2 = activation, use_kernel, backend, pow2
        ctx.groups_meta, ctx.deferral, ctx.need_dw = groups[1:], deferral, need_dw
        ctx.held = [h, xt, xt_s]  # (freed by the backward as it goes: the module docstring)
        ctx.save_for_backward(probs, groups.tensor, *dgrad_operands(ctx, q, s, qt, st, need_dx),
                              token_rows if need_dx else None, *weights)
        return z

    @staticmethod
    @not_twice_differentiable("the FP8 expert MLP (fc1 + activation)")
    def backward(ctx, dz):
        if not ctx.held or ctx.held[0] is None:
            raise RuntimeError("the FP8 expert MLP's fc1 + activation node frees h and x's FP8 columns during its "
                               "backward: it can be backpropagated through once (no retain_graph=True)")
        probs, groups, qt, st, token_rows, *weights = ctx.saved_tensors
        groups = Groups(groups, *ctx.groups_meta)
        need_dx, need_dprobs, need_dw = ctx.needs_input_grad[_X], ctx.needs_input_grad[_PROBS], ctx.need_dw
        if not _fc1_runs(ctx, probs is not None):  # (a backward for the probs alone: as two nodes, fc1's never ran)
            need_dx = need_dw = False
        need_dh = need_dx or need_dw
        h = ctx.held[0]
        ctx.held[0] = None
        dh, dprobs = act_times_probs_backward(dz, h, probs, ctx.activation, ctx.use_kernel, need_dh, need_dprobs)
        del h
        dx = None
        wgrads = [None] * len(weights)
        if need_dh:
            dhq, dh_s, dh_cols = quantize_output_grad(dh, groups, need_dx, need_dw, ctx.pow2, ctx.backend)
            del dh  # before the weight gradient allocates its result
            if need_dw:
                x_cols = ctx.held[1:]  # (handed over: freed once read)
                del ctx.held[1:]
                wgrads = weight_grads(weights, ctx.needs_input_grad[_WEIGHTS:], dh_cols, x_cols, groups, ctx.backend,
                                      ctx.deferral)
            if need_dx:
                dx = dgrad(dhq, dh_s, (qt, st), groups, ctx.backend, ctx.transpose_in_backward)
                if token_rows is not None:
                    dx = _permutation.run_combine_rows(dx, token_rows, ctx.backend)
        ctx.held.clear()
        return (dx, dprobs) + (None,) * (_WEIGHTS - 2) + tuple(wgrads)


def linear_activation(x, probs, groups: Groups, wq, rows, token_rows, activation, use_kernel, backend, pow2, deferral,
                      weights) -> torch.Tensor:
    """`act(grouped(x . W^T)) * probs` on arguments the module checked (megatron_tma.mlp_function): the node where a
    gradient is wanted, else the forward's kernels alone (inference: nothing kept)."""
    wants_grad = (x.requires_grad or (probs is not None and probs.requires_grad)
                  or any(w.requires_grad for w in weights))
    if not torch.is_grad_enabled() or not wants_grad:
        h = forward_keeping_columns(x, groups, wq.q, wq.s, rows, False, backend, pow2)[0]
        return act_times_probs_forward(h, probs, activation, use_kernel)
    if _saved_tensor_hooks_active():  # (the two nodes: the hooks see every tensor the backward reads)
        h = checked_linear(x, groups, wq, rows, token_rows, None, None, backend, pow2, deferral, weights)
        return _ActivationTimesProbs.apply(h, probs, activation, use_kernel)
    return _FP8GroupedLinearActivation.apply(x, probs, groups, wq.q, wq.s, wq.qt, wq.st, rows, token_rows, activation,
                                             use_kernel, backend, pow2, deferral, *weights)


def _fc1_runs(ctx, has_probs: bool) -> bool:
    """Whether this backward wants anything of fc1 (x's or a weight's gradient): as two nodes, the engine would not
    run fc1's at all for a backward that asks for the probs' gradient alone (`torch.autograd.grad(out, [probs])`),
    and a weight gradient made then would land in `main_grad` or a wgrad deferral. The edges are the forward's
    tensor inputs in order, x's first, then the probs' when given; only x's, the probs' and the weights' have a
    node (the FP8 copies and the permutation's indices want no gradient)."""
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if will_run is None:
        return True

    def wanted(fn):
        try:
            return will_run(fn)
        except RuntimeError:  # a leaf among torch.autograd.grad's inputs: its gradient is captured, so wanted
            return True

    edges = ctx.next_functions
    return any(fn is not None and wanted(fn) for fn, _ in (edges[:1] + edges[2:] if has_probs else edges))


def _saved_tensor_hooks_active() -> bool:
    """Whether a `saved_tensors_hooks` context is active here (torch's own query, as aot_autograd asks it)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None
