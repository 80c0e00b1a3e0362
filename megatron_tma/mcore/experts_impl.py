"""Megatron-LM's `--moe-experts-impl` flag, which `patches/` adds to Megatron-LM (megatron-core 0.19.2):

    torchrun ... pretrain_gpt.py <the MoE model's arguments> --moe-experts-impl megatron_tma-unpadded

(`megatron_tma-padded16` / `megatron_tma-padded128`, the padded twins, `megatron_tma-bf16`; `megatron`, the default,
keeps the layer spec's own experts). The patch adds the argument (`megatron/training/arguments.py`), carries it into
the model config (`GPTModelConfig.moe_experts_impl`: `megatron/training/argument_utils.py`, `models/gpt.py`), and in
`GPTModelBuilder.build_model`, once the layer spec is chosen (the builder's default for the arguments, or `--spec`'s)
and the multi-token-prediction block spec is made from it, hands both to `gpt_builder_hook`, which replaces the
experts of every MoE layer in them. So the flag swaps the experts in whatever spec the run builds, per pipeline stage
and model chunk, and everything else stays as the arguments say. The logic lives here so that the patch is a few
lines; the patched builder imports this module only when the flag is set.
"""
from typing import Optional, Tuple

from .config import MODES, expert_mlp_args

__all__ = ["CHOICES", "DEFAULT", "FIELD", "mode_of", "gpt_builder_hook"]

DEFAULT = "megatron"  # the layer spec's own experts (Megatron's)
PREFIX = "megatron_tma-"
CHOICES = (DEFAULT,) + tuple(PREFIX + mode for mode in MODES)  # the argument's choices, in the patch's order
FIELD = "moe_experts_impl"  # the patched GPTModelConfig's field (and Megatron-LM's argument, args.moe_experts_impl)


def mode_of(impl: Optional[str]) -> Optional[str]:
    """The megatron_tma experts mode `--moe-experts-impl` names (None: Megatron's own experts)."""
    if impl is None or impl == DEFAULT:
        return None
    if impl not in CHOICES:
        raise ValueError(f"--moe-experts-impl must be one of {', '.join(CHOICES)}, got {impl!r}")
    return impl[len(PREFIX):]


def gpt_builder_hook(model_config, layer_spec, mtp_spec=None, backend: str = "auto") -> Tuple[object, object]:
    """What the patched `GPTModelBuilder.build_model` calls: `(layer_spec, mtp_spec)` with megatron_tma's experts in
    every MoE layer when `model_config.moe_experts_impl` names them, else both unchanged. `model_config` is the
    `GPTModelConfig` (its `transformer` the `TransformerConfig`); `layer_spec` a layer or block spec, `mtp_spec` the
    multi-token-prediction block spec or None. Refuses, naming the argument or the config field, a model without
    MoE layers, the expert settings megatron_tma does not implement (`config.expert_mlp_args`), and `--spec` specs
    that already hold megatron_tma experts in another mode."""
    impl = getattr(model_config, FIELD, None)
    mode = mode_of(impl)
    if mode is None:
        return layer_spec, mtp_spec
    config = getattr(model_config, "transformer", model_config)
    if not getattr(config, "num_moe_experts", None):
        raise ValueError(f"--moe-experts-impl {impl}: the model has no MoE layer (--num-experts is not set)")
    expert_mlp_args(config)  # the refusals (biases, latent projections, ...) before any layer is built
    from .spec import replace_experts

    new_spec, swapped = replace_experts(layer_spec, mode, backend)
    # A block spec may hold no MoE layer on this pipeline stage (--moe-layer-freq, or no decoder layer at all); a
    # layer spec is every layer's, so without an MoE layer in it the flag would do nothing anywhere.
    if not swapped and not hasattr(layer_spec, "layer_specs"):
        raise ValueError(f"--moe-experts-impl {impl}: the layer spec has no MoE layer whose experts could be "
                         f"replaced ({type(layer_spec).__name__} of {getattr(layer_spec, 'module', None)})")
    if mtp_spec is not None:
        mtp_spec, _ = replace_experts(mtp_spec, mode, backend)
    return new_spec, mtp_spec
