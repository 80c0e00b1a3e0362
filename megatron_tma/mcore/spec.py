"""The switch in a Megatron model: a GPT layer (or block) spec whose MoE layers build megatron_tma experts.

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True)        # or the Transformer Engine spec
    config.moe_megatron_tma_experts = "unpadded"                                  # the config flag (None: Megatron's)
    spec = layer_spec_from_config(spec, config)                   # = use_megatron_tma_experts(spec, config.<flag>)
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)

Only the `experts` builder of each `MoELayer` changes: the router, the token dispatcher (and its all-to-all over
expert-parallel ranks), the shared experts and the dense layers stay Megatron's. Works on the builder form of
megatron-core 0.19 (`functools.partial(MoELayer, submodules=MoESubmodules(...))`) and on `ModuleSpec(MoELayer, ...)`.
"""
import copy
import dataclasses
import functools
from typing import Optional

from megatron.core.transformer.moe.moe_layer import MoELayer

from .config import CONFIG_FLAG, MODES, expert_mlp_args
from .experts import megatron_experts

__all__ = ["use_megatron_tma_experts", "layer_spec_from_config", "megatron_lm_spec"]


def _is_moe(builder) -> bool:
    module = builder.func if isinstance(builder, functools.partial) else getattr(builder, "module", None)
    return isinstance(module, type) and issubclass(module, MoELayer)


def _swap_experts(builder, experts):
    if isinstance(builder, functools.partial):  # partial(MoELayer, submodules=MoESubmodules(...))
        subs = dataclasses.replace(builder.keywords["submodules"], experts=experts)
        return functools.partial(builder.func, *builder.args, **{**builder.keywords, "submodules": subs})
    spec = copy.copy(builder)  # ModuleSpec(module=MoELayer, submodules=MoESubmodules(...))
    spec.submodules = dataclasses.replace(builder.submodules, experts=experts)
    return spec


def _swap_layer(layer_spec, experts):
    subs = getattr(layer_spec, "submodules", None)
    if subs is None or not _is_moe(getattr(subs, "mlp", None)):
        return layer_spec, 0  # a dense layer (e.g. moe_layer_freq): unchanged
    new = copy.copy(layer_spec)
    new.submodules = dataclasses.replace(subs, mlp=_swap_experts(subs.mlp, experts))
    return new, 1


def use_megatron_tma_experts(spec, mode: Optional[str], backend: str = "auto"):
    """A copy of `spec` (a TransformerLayer `ModuleSpec`, or a `TransformerBlockSubmodules` with `layer_specs`)
    whose MoE layers build `megatron_tma.mcore.experts` in `mode`; `mode=None` returns `spec` itself. Raises if
    the spec has no MoE layer (the flag would silently do nothing)."""
    if mode is None:
        return spec
    if mode not in MODES:
        raise ValueError(f"{CONFIG_FLAG} must be None or one of {', '.join(MODES)}, got {mode!r}")
    experts = functools.partial(megatron_experts, mode=mode, backend=backend)
    if hasattr(spec, "layer_specs"):
        layers = [_swap_layer(s, experts) for s in spec.layer_specs]
        swapped = sum(n for _, n in layers)
        new = dataclasses.replace(spec, layer_specs=[s for s, _ in layers])
    else:
        new, swapped = _swap_layer(spec, experts)
    if not swapped:
        raise ValueError("the spec has no MoE layer whose experts could be replaced (build it with num_experts)")
    return new


def layer_spec_from_config(spec, config, backend: str = "auto"):
    """`use_megatron_tma_experts(spec, config.moe_megatron_tma_experts)`: the config flag, None when unset."""
    return use_megatron_tma_experts(spec, getattr(config, CONFIG_FLAG, None), backend)


def megatron_lm_spec(args, config, mode: str, backend: str = "auto"):
    """The layer spec Megatron-LM's GPT builder (`gpt_builders.gpt_builder`) picks for an MoE model from its parsed
    `args` (the decoder block spec, with Transformer Engine or local modules per `--transformer-impl`), with
    megatron_tma's experts in `mode`; `config` is `core_transformer_config_from_args(args)`. What `--spec
    megatron_tma.mcore.megatron_lm MODE` hands Megatron-LM. Refuses what that builder would build differently, and
    the expert settings megatron_tma does not implement, with the argument named, before any layer is built. With
    virtual pipeline stages it hands a layer spec instead (see `_uniform_layer_spec`)."""
    if mode not in MODES:
        raise ValueError(f"--spec megatron_tma.mcore.megatron_lm MODE: MODE must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    if not getattr(args, "num_experts", None):
        raise ValueError("megatron_tma's experts need an MoE model: --num-experts is not set")
    if getattr(args, "experimental_attention_variant", None) is not None:
        raise ValueError("--experimental-attention-variant builds another block spec; not supported with "
                         "megatron_tma's experts")
    if getattr(args, "transformer_impl", None) == "inference_optimized":
        raise ValueError("--transformer-impl inference_optimized has no MoE block spec in Megatron-LM")
    expert_mlp_args(config)  # the refusals (biases, expert TP, ...) now, naming the field
    use_te = args.transformer_impl == "transformer_engine"
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is not None:
        return use_megatron_tma_experts(_uniform_layer_spec(config, use_te, args), mode, backend)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    base = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                      qk_l2_norm=args.qk_l2_norm)
    return use_megatron_tma_experts(base, mode, backend)


def _uniform_layer_spec(config, use_te: bool, args):
    """With virtual pipeline stages Megatron-LM's builder makes one block spec per model chunk (its layers depend on
    the chunk), while `--spec` hands it one object. A layer spec is what works for every chunk: TransformerBlock
    repeats it for the chunk's own layers. It builds what the builder would when every layer has the same spec and
    TransformerBlock's final norm for a layer spec is the one the builder's block spec names; anything else is
    refused, naming why."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ValueError("virtual pipeline stages with --pipeline-model-parallel-layout need one block spec per "
                         "stage, and Megatron-LM's --spec gives one; not supported with megatron_tma's experts")
    layers = gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                         normalization=args.normalization, qk_l2_norm=args.qk_l2_norm)
    if any(layer is not layers[0] for layer in layers):
        raise ValueError("virtual pipeline stages with dense and MoE layers mixed (--moe-layer-freq) need one block "
                         "spec per stage, and Megatron-LM's --spec gives one; not supported with megatron_tma's experts")
    builders_norm = gpt_layer_specs.TENorm if use_te else gpt_layer_specs.LNImpl
    if builders_norm is not transformer_block.LayerNormImpl:
        raise ValueError(f"virtual pipeline stages: a layer spec would give the final norm "
                         f"{transformer_block.LayerNormImpl.__name__}, Megatron-LM's builder {builders_norm.__name__} "
                         f"(--transformer-impl {args.transformer_impl}); not supported with megatron_tma's experts")
    return layers[0]
