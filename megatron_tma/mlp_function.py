"""The expert MLP's step, `fc2(act(fc1(x)) * probs)`, with every check made once per call by the module
(megatron_tma.mlp.GroupedFP8MLP) and nothing per kernel but the kernel's own op.

Why: the eager layer step is host-bound on fine-grained experts (Qwen3-30B-A3B's 128 experts of FFN 768: the GPU
work of a step is shorter than the host time to enqueue it). Through the public entries (`fp8_grouped_linear` twice,
`activation_times_probs`) each part runs its own argument rules, group check and weight look-up, and each linear is
called as a module; here the module's one check of its inputs and one plan (`MlpPlan`: the checked groups, both
linears' FP8 weight copies, the permutation) stand for all of them, and two autograd nodes run the kernels: fc1 with
the activation (megatron_tma.linear_activation: the gather fused into x's quantizer; its backward drops dh's BF16 copy,
h and x's columns as it goes, which lowers the backward's peak) and fc2's `_FP8GroupedLinear` (the combine; backward
gathers dY's rows in its quantizer). The kernels, their order and arguments and the bits are the composed call's
(tests/test_mlp_function.py compares both with `torch.equal`; tests/test_mlp_gpu.py on the kernels). Two nodes, not
one: a single Function would keep fc2's saved columns and the incoming dY alive through fc1's whole backward.

What the module hands over is checked by the module; this file checks nothing again.
"""
from typing import NamedTuple, Optional, Sequence

import torch

from .autograd import QuantizedWeights, checked_linear
from .groups import Groups
from .linear_activation import linear_activation
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


def fp8_expert_mlp(x: torch.Tensor, probs: Optional[torch.Tensor], plan: MlpPlan, fc1_weights: Sequence[torch.Tensor],
                   fc2_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The MLP's output (module docstring); `plan` as the module checked it. A linear whose input and weights want no
    gradient (or with grad mode off) runs its forward's kernels alone, as the public entry does."""
    z = linear_activation(x, probs, plan.groups, plan.fc1, plan.rows, plan.token_rows, plan.activation, plan.use_kernel,
                          plan.backend, plan.pow2, plan.deferral1, fc1_weights)
    return checked_linear(z, plan.groups, plan.fc2, None, None, plan.rows, plan.token_rows, plan.backend, plan.pow2,
                          plan.deferral2, fc2_weights)
