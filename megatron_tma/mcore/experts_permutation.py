"""The experts permute their own tokens: Megatron's all-to-all dispatcher without its permuted BF16 copy.

megatron-core 0.19.2's `MoEAlltoAllTokenDispatcher` permutes the routed tokens `[T, H]` into `[T k, H]` BF16 rows
grouped by expert before the experts run (`dispatch_preprocess`: `permute`, Transformer Engine's fused kernel with
`moe_permute_fusion`), and adds the experts' output rows back into tokens after them (`combine_postprocess`:
`unpermute`). For megatron_tma's FP8 experts the permuted copy is pure traffic: they read it once, to quantize it.
Here the dispatcher hands the experts the tokens as they are, with a `megatron_tma.permutation.Permutation` in
Megatron's permuted order, and skips both copies; the experts gather the rows inside their first quantizer and
combine their output rows per token themselves (FP32 sum of each token's k rows in a fixed order, one rounding:
deterministic). Per MoE layer and step this removes a `[T k, H]` BF16 write and read from the forward. The rest
moves one for one: the combine replaces the un-permutation (forward) and the permutation's backward (the input
gradient); the combine's backward, a gather of the output gradient, is fused into the second linear's backward
quantizer, which removes the BF16 copy of that gradient too.

Same conditions as `megatron_tma.mcore.device_token_counts` (EP = 1, TP = 1, megatron_tma experts, no token
dropping, no router padding, no CUDA graphs, the identity chunk sort), whose patch this one includes: the counts stay
on the GPU. Also refused: the BF16 experts (mode `bf16`: they need the permuted BF16 rows anyway; their counts
still stay on the GPU), `moe_apply_probs_on_input` (the probs would scale the permuted rows before the quantizer's
gather) and `moe_shared_expert_overlap` (Megatron launches those shared experts from inside the dispatch).

The bits: the experts' rows are the same as with Megatron's permutation. The combined output is the fixed-order FP32
sum; Megatron's torch un-permutation adds the BF16 rows in place (with atomics on the GPU, so in no fixed order), and
Transformer Engine's fused one (`moe_permute_fusion`) also sums in FP32 per token, in an order not checked here. At
top-2 the patched layer gives Megatron's bits (tests/test_mcore_experts_permutation.py, on the CPU and the GPU);
from top-3 on, the combined output and the input gradient can differ from Megatron's torch path in the last bits
(its BF16 adds, in atomic order, against one FP32 sum). The twins (`unpadded`, `padded16`, `padded128`) stay equal bit for bit under it.

`permute_in_experts(model)` patches each eligible MoE layer's dispatcher instance; `enable=False` takes it (and the
device-count patch) away.
"""
import types
from typing import Dict, Optional

import torch

from ..permutation import permutation_from_routing_map
from . import device_token_counts
from .experts import MegatronFP8Experts

__all__ = ["permute_in_experts", "refusal"]


def _dispatch_preprocess(self, hidden_states, routing_map, probs):
    # megatron-core 0.19.2's dispatch_preprocess, at EP x TP = 1 and without router padding (`refusal`), with the
    # permutation of the tokens left to the experts.
    self.hidden_shape = hidden_states.shape
    self.probs = probs
    self.routing_map = routing_map
    hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
    self.tokens_per_expert = self.preprocess(self.routing_map)
    if self.shared_experts is not None:
        self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
    self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
    self.hidden_shape_before_permute = hidden_states.shape
    permutation, _, permuted_probs = permutation_from_routing_map(routing_map, self.config.moe_router_topk, probs)
    self._megatron_tma_experts._pending_permutation = permutation
    return hidden_states, permuted_probs


def _combine_postprocess(self, hidden_states):
    # The experts returned the combined tokens; what is left of Megatron's method is the reshape and the shared
    # experts' output.
    output = hidden_states.view(self.hidden_shape)
    if self.shared_experts is not None:
        output = output + self.shared_experts.get_output()
    return output


_METHODS = {"dispatch_preprocess": _dispatch_preprocess, "combine_postprocess": _combine_postprocess}


def refusal(layer) -> Optional[str]:
    """Why the experts of this MoE layer cannot permute their own tokens (a sentence), or None if they can."""
    reason = device_token_counts.refusal(layer)
    if reason is not None:
        return reason
    if not isinstance(layer.experts, MegatronFP8Experts):
        return ("the BF16 experts read the permuted rows in BF16 anyway: Megatron's permutation costs them nothing "
                "extra (their token counts stay on the GPU)")
    config = layer.token_dispatcher.config
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input: the probs scale the permuted rows before the experts"
    if getattr(config, "moe_shared_expert_overlap", False):
        # the overlapped shared experts are launched from inside the dispatch with the dispatched tokens (not tested
        # with tokens that are not permuted)
        return "moe_shared_expert_overlap: left to Megatron's permutation"
    return None


def permute_in_experts(model: torch.nn.Module, enable: bool = True) -> Dict[str, Optional[str]]:
    """For every MoE layer in `model`: let its experts permute their own tokens (module docstring) where `refusal`
    finds nothing against it; the layer's token counts then stay on the GPU too
    (`device_token_counts.keep_token_counts_on_device`). Returns {layer name: None if patched, else the reason}.
    `enable=False` restores Megatron's methods on every layer (the device-count patch's too)."""
    report = {}
    for name, module in model.named_modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        for method in _METHODS:
            dispatcher.__dict__.pop(method, None)
        dispatcher.__dict__.pop("_megatron_tma_experts", None)
        reason = refusal(module) if enable else "not enabled"
        report[name] = reason
    device_token_counts.keep_token_counts_on_device(model, enable=enable)
    for name, module in model.named_modules():
        if report.get(name, "absent") is None:
            dispatcher = module.token_dispatcher
            dispatcher._megatron_tma_experts = module.experts
            for method, fn in _METHODS.items():
                setattr(dispatcher, method, types.MethodType(fn, dispatcher))
    return report
