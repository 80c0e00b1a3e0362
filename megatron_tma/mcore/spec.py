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

from .._ext import check_backend
from .config import CONFIG_FLAG, MODES, expert_mlp_args
from .experts import megatron_experts

__all__ = ["use_megatron_tma_experts", "layer_spec_from_config", "megatron_lm_spec", "check_megatron_lm_spec",
           "replace_experts"]


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
    check_backend(backend)  # here, not when Megatron builds the model from the spec
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


def _experts_mode(builder) -> Optional[str]:
    """The mode of a megatron_tma experts builder, None for any other builder (Megatron's own experts)."""
    if isinstance(builder, functools.partial) and builder.func is megatron_experts:
        return builder.keywords.get("mode", "unpadded")
    return None


def _moe_submodules(builder):
    return builder.keywords["submodules"] if isinstance(builder, functools.partial) else builder.submodules


def _replace_in(obj, experts, mode: str, depth: int):
    """(obj with every MoE layer's experts replaced, how many MoE layers it holds); obj itself when none."""
    if depth > 32:
        return obj, 0
    if _is_moe(obj):
        theirs = _experts_mode(_moe_submodules(obj).experts)
        if theirs is not None and theirs != mode:
            raise ValueError(f"the layer spec already has megatron_tma's {theirs} experts (--spec), and "
                             f"{mode} was asked for (--moe-experts-impl): name one")
        return _swap_experts(obj, experts), 1
    if isinstance(obj, (list, tuple)):
        items = [_replace_in(item, experts, mode, depth + 1) for item in obj]
        count = sum(n for _, n in items)
        if not count:
            return obj, 0
        new_items = [item for item, _ in items]
        return (type(obj)(*new_items) if hasattr(obj, "_fields") else type(obj)(new_items)), count
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # ModuleSpec, *Submodules
        changed, count = {}, 0
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name, None)
            new, n = _replace_in(value, experts, mode, depth + 1)
            count += n
            if new is not value:
                changed[field.name] = new
        if not changed:
            return obj, count
        new_obj = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(new_obj, name, value)
        return new_obj, count
    return obj, 0


def replace_experts(spec, mode: str, backend: str = "auto"):
    """(a copy of `spec` whose every MoE layer builds megatron_tma's experts in `mode`, how many MoE layer specs it
    holds): a layer spec, a block spec (`TransformerBlockSubmodules`), a multi-token-prediction block spec, any
    tree of `ModuleSpec`s and spec dataclasses. Parts without an MoE layer are shared, not copied; `spec` itself is
    returned, with 0, when it has none. Raises if an MoE layer already has megatron_tma's experts in another mode.
    What `--moe-experts-impl` does to the specs Megatron-LM's GPT builder makes (`experts_impl`)."""
    if mode not in MODES:
        raise ValueError(f"experts mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_backend(backend)  # here, not when Megatron builds the model from the spec
    experts = functools.partial(megatron_experts, mode=mode, backend=backend)
    return _replace_in(spec, experts, mode, 0)


def layer_spec_from_config(spec, config, backend: str = "auto"):
    """`use_megatron_tma_experts(spec, config.moe_megatron_tma_experts)`: the config flag, None when unset."""
    return use_megatron_tma_experts(spec, getattr(config, CONFIG_FLAG, None), backend)


def megatron_lm_spec(args, config, mode: str, backend: str = "auto", vp_stage: Optional[int] = None):
    """The layer spec Megatron-LM's GPT builder picks for an MoE model from its parsed `args` (the decoder block
    spec, with Transformer Engine or local modules per `--transformer-impl`), with megatron_tma's experts in `mode`;
    `config` is `core_transformer_config_from_args(args)`. What `--spec megatron_tma.mcore.megatron_lm MODE` hands
    Megatron-LM. Refuses what that builder would build differently, and the expert settings megatron_tma does not
    implement, with the argument named, before any layer is built. `vp_stage`: the model chunk, where the caller
    builds one spec per chunk (megatron-core 0.19's `GPTModelBuilder`); with virtual pipeline stages and no
    `vp_stage` (one spec for every chunk) it hands a layer spec instead (see `_uniform_layer_spec`)."""
    check_megatron_lm_spec(args, config, mode)
    use_te = args.transformer_impl == "transformer_engine"
    if getattr(args, "virtual_pipeline_model_parallel_size", None) is not None and vp_stage is None:
        return use_megatron_tma_experts(_uniform_layer_spec(config, use_te, args), mode, backend)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    base = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                      qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    return replace_experts(base, mode, backend)[0]  # a pipeline stage may hold no MoE layer (--moe-layer-freq)


def check_megatron_lm_spec(args, config, mode: str) -> None:
    """`megatron_lm_spec`'s refusals, which need neither the parallel state nor a layer built."""
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
