"""The experts' weight gradients deferred to the end of Megatron's step: one K-grouped GEMM per expert linear a step,
over every micro-batch's tokens, instead of one per micro-batch (megatron_tma.wgrad_deferral says what it saves and
how the operands are laid out).

    from megatron_tma.mcore import defer_expert_wgrads
    defer_expert_wgrads(model_chunks, config)      # after DDP wraps the chunks and config.finalize_model_grads_func is set

Megatron's schedule calls `config.finalize_model_grads_func` once after the last micro-batch's backward, before the
gradients are reduced and the optimizer steps; the experts' pending gradients are computed into `main_grad` first
(a wrapper of that function). With DDP's overlapped gradient reduction a bucket's reduction starts inside the last
backward, before that point, so the two are refused together. The deferred backward hands autograd no weight gradient
(DDP's non-overlapped hooks have nothing to add: the GEMM accumulates into `main_grad` itself at the flush).
"""
from typing import Sequence

import torch

from ..wgrad_deferral import WgradDeferral
from .experts import MegatronFP8Experts

__all__ = ["defer_expert_wgrads"]


def defer_expert_wgrads(model_chunks: Sequence[torch.nn.Module], config) -> int:
    """Make every megatron_tma FP8 expert module in `model_chunks` defer its weight gradients, flushed by a wrapper of
    `config.finalize_model_grads_func`; returns how many expert modules it found (0: nothing changed)."""
    experts = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MegatronFP8Experts)]
    if not experts:
        return 0
    for chunk in model_chunks:
        if getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False):
            raise ValueError("deferred expert weight gradients need overlap_grad_reduce=False: with it DDP reduces a "
                             "bucket inside the last micro-batch's backward, before the deferred GEMM has run")
    original = getattr(config, "finalize_model_grads_func", None)
    if original is None:
        raise ValueError("deferred expert weight gradients are computed before config.finalize_model_grads_func, "
                         "which is not set: set it (Megatron's finalize_model_grads) first")
    if getattr(original, "_megatron_tma_flushes", None) is not None:
        experts = original._megatron_tma_flushes + [e for e in experts if e not in original._megatron_tma_flushes]
        original = original.__wrapped__
    for e in experts:
        for linear in (e.linear_fc1, e.linear_fc2):
            if linear.wgrad_deferral is None:
                linear.wgrad_deferral = WgradDeferral()

    def finalize_model_grads(*args, **kwargs):
        for e in experts:
            e.flush_wgrad()
        return original(*args, **kwargs)

    finalize_model_grads._megatron_tma_flushes = experts
    finalize_model_grads.__wrapped__ = original
    config.finalize_model_grads_func = finalize_model_grads
    return len(experts)
