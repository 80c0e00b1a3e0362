"""Token counts that stay on the GPU: Megatron's all-to-all dispatcher without its host sync, for our experts.

megatron-core 0.19.2's `MoEAlltoAllTokenDispatcher` copies the per-expert token counts to the host in every forward
of every MoE layer and makes the host wait for that copy (`_maybe_dtoh_and_synchronize`; at EP = 1 and TP = 1 the
sync point is "before_permutation_2", or "before_finish" with one local expert or with `moe_permute_fusion`),
because `TEGroupedMLP` and `SequentialMLP` need the counts on the host (`m_splits`, `torch.split`). megatron_tma's
experts read them on the GPU, and at EP = 1, TP = 1 nothing else in the dispatcher needs them there: the only
consumer is the chunk sort by local expert (`sort_chunks_by_idxs`, forward and combine), which at EP x TP = 1 is the
identity permutation and is skipped here too (two full copies of the routed tokens and their autograd nodes per
layer and micro-batch). The host then never waits on the GPU inside the MoE layer, and the experts get the counts
tensor the dispatcher's preprocessing computed, on the GPU. Results are the same bits: the sort was an identity, and
the counts are the same numbers on another device.

Megatron builds the dispatcher in `MoELayer.__init__`, not from the layer spec, so this works on a built model:
`keep_token_counts_on_device(model)` gives each eligible layer's dispatcher instance methods that shadow the three
class methods, and `enable=False` takes them away. A layer is left alone, with the reason returned, where the
counts or the sort are needed on the host or are not static (`refusal`).
"""
import types
from typing import Dict, Optional

import torch

from .experts import _MegatronExperts

__all__ = ["keep_token_counts_on_device", "refusal"]

def _no_host_copy(self, point, tokens_per_expert=None):
    # The class method copies the counts (and the all-to-all splits, None at EP = 1) to the host on a side stream
    # and waits for them at the sync point; here they stay where preprocess computed them.
    del point
    return tokens_per_expert


def _dispatch_postprocess(self, global_input_tokens, global_probs):
    # At EP x TP = 1 there is no TP gather, and the sort by local expert is the identity (checked by `refusal`).
    tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
    return global_input_tokens, tokens_per_expert, global_probs


def _combine_preprocess(self, hidden_states):
    return hidden_states  # the identity un-sort; no TP reduce-scatter at TP = 1


_METHODS = {"_maybe_dtoh_and_synchronize": _no_host_copy, "dispatch_postprocess": _dispatch_postprocess,
            "combine_preprocess": _combine_preprocess}
_PATCHED = tuple(_METHODS)  # the dispatcher's methods an instance of it gets shadowed


def _is_identity(order) -> bool:
    # once per layer when patching, never per step (the index lives on the GPU with moe_permute_fusion)
    order = torch.as_tensor(order).cpu()
    return torch.equal(order, torch.arange(order.numel(), dtype=order.dtype))


def refusal(layer) -> Optional[str]:
    """Why the token counts of this MoE layer must go to the host (a sentence), or None if they may stay on the
    GPU. Reads megatron-core 0.19.2's dispatcher and config fields."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = getattr(layer, "token_dispatcher", None)
    if type(dispatcher) is not MoEAlltoAllTokenDispatcher:
        return f"the dispatcher is {type(dispatcher).__name__}, not the all-to-all dispatcher"
    if hasattr(layer, "_inference_token_dispatcher"):
        # config.transformer_impl == "inference_optimized": MoELayer.forward swaps `token_dispatcher` per forward
        return "an inference-optimized layer swaps its dispatcher at every forward"
    if not isinstance(getattr(layer, "experts", None), _MegatronExperts):
        return (f"the experts are {type(layer.experts).__name__}, which need the counts on the host "
                "(only megatron_tma's experts read them on the GPU)")
    if dispatcher.ep_size != 1 or dispatcher.tp_size != 1:
        return (f"expert parallel size {dispatcher.ep_size}, expert tensor parallel size {dispatcher.tp_size}: the "
                "all-to-all splits are needed on the host")
    config = dispatcher.config
    if dispatcher.drop_and_pad or getattr(config, "moe_expert_capacity_factor", None) is not None:
        return "token dropping (moe_expert_capacity_factor): the dispatcher sizes its output on the host"
    if getattr(config, "moe_router_padding_for_quantization", False):
        return "moe_router_padding_for_quantization: the dispatcher sizes its output on the host"
    if (getattr(config, "cuda_graph_impl", "none") or "none") not in ("none", "full_iteration"):
        # Per-layer graphs: a captured dispatcher hands out graph buffers as the counts, which a later replay may
        # overwrite while an eager consumer still reads them; Megatron's own graph path has its own D2H point. Not
        # changed. A full-iteration graph holds the counts' producer and every reader of them in one graph.
        return f"cuda_graph_impl={config.cuda_graph_impl!r}: left to Megatron's CUDA-graph handling"
    if not (_is_identity(dispatcher.sort_input_by_local_experts)
            and _is_identity(dispatcher.restore_output_by_local_experts)):
        return "the chunk sort by local expert is not the identity"
    return None


def keep_token_counts_on_device(model: torch.nn.Module, enable: bool = True) -> Dict[str, Optional[str]]:
    """For every MoE layer in `model` (anything with a `token_dispatcher`): keep its token counts on the GPU
    (module docstring) where `refusal` finds nothing against it. Returns {layer name: None if its counts stay on the
    GPU, else the reason they go to the host}. `enable=False` restores Megatron's methods on every layer."""
    report = {}
    for name, module in model.named_modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        for method in _PATCHED:
            dispatcher.__dict__.pop(method, None)
        reason = refusal(module) if enable else "not enabled"
        if reason is None:
            for method, fn in _METHODS.items():
                setattr(dispatcher, method, types.MethodType(fn, dispatcher))
        report[name] = reason
    return report
