"""Megatron-core integration: megatron_tma's expert MLPs as the experts of Megatron's `MoELayer`.

* `config` (no Megatron import): which expert MLP a `TransformerConfig` describes, and the refusals;
* `experts`: the experts builder and modules (`megatron_experts`, modes in `MODES`); megatron-core only to draw
  the initial weights under its RNG tracker;
* `spec`: the switch in a layer spec (`use_megatron_tma_experts`, `layer_spec_from_config`, the config flag); it
  imports megatron-core (0.19) and loads when first used; `megatron_lm_spec`, the spec Megatron-LM's GPT builder
  would pick, with these experts;
* `megatron_lm`: Megatron-LM's switch, `pretrain_gpt.py ... --spec megatron_tma.mcore.megatron_lm unpadded` (import
  it only there: it reads Megatron-LM's parsed arguments);
* `device_token_counts`: `keep_token_counts_on_device(model)`, Megatron's all-to-all dispatcher without its host
  sync per MoE layer where our experts are its only reader of the counts (EP = 1, TP = 1, dropless);
* `experts_permutation`: `permute_in_experts(model)`, the same dispatcher handing the experts the tokens as they are:
  the experts gather the rows inside their first quantizer and combine their output per token (no permuted BF16
  copy either way);
* `wgrad_deferral`: `defer_expert_wgrads(model_chunks, config)`, the experts' weight gradients computed once a step,
  over every micro-batch, before Megatron's `finalize_model_grads`;
* `held_memory`: `held_bytes(models, optimizer)`, what each byte of a training state held between steps is (expert
  and other weights, FP8 copies, gradients, FP32 masters, Adam's moments);
* `experts_impl`: Megatron-LM's flag `--moe-experts-impl megatron_tma-unpadded`, which `patches/` adds: its choices
  and the hook the patched GPT builder calls (no Megatron import until the hook runs).
The recipe that trains a small MoE GPT with each mode under torchrun and compares them is `recipes/moe_gpt.py`.
"""
import importlib

from .config import CONFIG_FLAG, MODES, REFRESH_FLAG, RELEASE_FLAG, TRANSPOSE_FLAG, ExpertMLPArgs, expert_mlp_args, from_sequential_mlp_key, pad_to_of
from .device_token_counts import keep_token_counts_on_device
from .experts_permutation import permute_in_experts
from .experts import MegatronBF16Experts, MegatronFP8Experts, invalidate_fp8_weights, megatron_experts
from .wgrad_deferral import defer_expert_wgrads

__all__ = ["MODES", "ExpertMLPArgs", "expert_mlp_args", "pad_to_of", "from_sequential_mlp_key", "megatron_experts",
           "MegatronFP8Experts", "MegatronBF16Experts", "invalidate_fp8_weights", "keep_token_counts_on_device",
           "permute_in_experts", "defer_expert_wgrads",
           "CONFIG_FLAG", "TRANSPOSE_FLAG", "REFRESH_FLAG", "RELEASE_FLAG", "use_megatron_tma_experts", "layer_spec_from_config", "megatron_lm_spec",
           "replace_experts"]

_LAZY = {"use_megatron_tma_experts": "spec", "layer_spec_from_config": "spec", "megatron_lm_spec": "spec",
         "replace_experts": "spec"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
