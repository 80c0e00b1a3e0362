"""The experts' weight gradients deferred to the end of Megatron's step: one K-grouped GEMM per expert linear a step,
over every micro-batch's tokens, instead of one per micro-batch (megatron_tma.wgrad_deferral says what it saves and
how the operands are laid out).

    from megatron_tma.mcore import defer_expert_wgrads
    defer_expert_wgrads(model_chunks, config)      # after DDP wraps the chunks and config.finalize_model_grads_func is set

Megatron's DDP tells the step's last micro-batch apart: its `no_sync` context (the schedule's `no_sync_func`, around
every micro-batch but the last) clears `is_last_microbatch` on the bucket groups. In the last micro-batch each expert
linear's backward computes every pending gradient of the step into `main_grad` in one GEMM and only then hands DDP
its (dummy) gradient, so DDP's hooks, which start a bucket's reduction there when it is overlapped
(`overlap_grad_reduce`), see the whole gradient. The earlier backwards hand DDP a dummy marked as already added, as
every backward of these experts does. Whatever is still pending when Megatron's schedule calls
`config.finalize_model_grads_func` (expert weights outside DDP's buckets) is computed first by a wrapper of it.
"""
from typing import Sequence

import torch

from ..wgrad_deferral import WgradDeferral
from .experts import MegatronFP8Experts

__all__ = ["defer_expert_wgrads"]


def _last_micro_batch_signal(chunk, weight):
    """A callable telling whether Megatron's DDP is in the step's last micro-batch for `weight` (its bucket group's
    `is_last_microbatch`, which DDP's `no_sync` clears for the others), or None outside Megatron's DDP."""
    group = getattr(chunk, "param_to_bucket_group", {}).get(weight)
    if group is None or not hasattr(group, "is_last_microbatch"):
        return None
    return lambda: group.is_last_microbatch


def defer_expert_wgrads(model_chunks: Sequence[torch.nn.Module], config) -> int:
    """Make every megatron_tma FP8 expert module in `model_chunks` defer its weight gradients: under Megatron's DDP
    each expert linear computes all of them in the step's last micro-batch (DDP's `is_last_microbatch`), before its
    hooks may start the reduction, overlapped or not; anything still pending (outside DDP, a schedule without
    `no_sync`) is computed by a wrapper of `config.finalize_model_grads_func`. Returns how many expert modules it
    found (0: nothing changed)."""
    found = [(chunk, m) for chunk in model_chunks for m in chunk.modules() if isinstance(m, MegatronFP8Experts)]
    if not found:
        return 0
    original = getattr(config, "finalize_model_grads_func", None)
    if original is None:
        raise ValueError("deferred expert weight gradients are computed before config.finalize_model_grads_func, "
                         "which is not set: set it (Megatron's finalize_model_grads) first")
    for chunk, e in found:
        for linear in (e.linear_fc1, e.linear_fc2):
            is_last = _last_micro_batch_signal(chunk, linear.weights[0])
            if is_last is None and getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False):
                raise ValueError("deferred expert weight gradients with overlap_grad_reduce need Megatron's DDP "
                                 "bucket groups (is_last_microbatch) to compute them in the last micro-batch: these "
                                 "expert weights have none")
            if linear.wgrad_deferral is None:
                linear.wgrad_deferral = WgradDeferral(is_last)
            else:
                linear.wgrad_deferral.is_last = is_last
    experts = [e for _, e in found]
    if getattr(original, "_megatron_tma_flushes", None) is not None:
        experts = original._megatron_tma_flushes + [e for e in experts if e not in original._megatron_tma_flushes]
        original = original.__wrapped__

    def finalize_model_grads(*args, **kwargs):
        for e in experts:
            e.flush_wgrad()
        return original(*args, **kwargs)

    finalize_model_grads._megatron_tma_flushes = experts
    finalize_model_grads.__wrapped__ = original
    config.finalize_model_grads_func = finalize_model_grads
    return len(experts)
