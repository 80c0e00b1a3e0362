"""The GPU job's model: Megatron's GPT with the experts of a mode, its DDP wrappers and optimizer, Megatron's own
experts given megatron_tma's initial weights, and the weights' canonical names."""
import contextlib
import re

import torch
import torch.nn.functional as F

from megatron_tma.mcore import (CONFIG_FLAG, REFRESH_FLAG, RELEASE_FLAG, TRANSPOSE_FLAG, defer_expert_wgrads,
                                from_sequential_mlp_key, megatron_experts)
from megatron_tma.released_weights import attach_optimizer

from . import megatron_core as mc
from .options import MEGATRONS_OWN, graphed


def ddp_settings(args):
    """The DistributedDataParallelConfig fields of the run's data-parallel options (the optimizer config takes
    `use_distributed_optimizer` too)."""
    settings = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
                    use_distributed_optimizer=args.distributed_optimizer,
                    overlap_param_gather=args.overlap_param_gather)
    if args.ddp_bucket_size is not None:
        settings["bucket_size"] = args.ddp_bucket_size
    return settings


def model_settings(args):
    """The TransformerConfig fields of the spec and precision options: Megatron-LM's `--transformer-impl`,
    `--fp8-format` / `--fp8-recipe` (TE FP8 of the TE layers under Megatron's FP8 context), the shared expert.
    Never `moe_router_padding_for_quantization` (alias `moe_router_padding_for_fp8`): it would pad every expert's
    routed tokens for FP8 in Megatron's dispatcher, which megatron_tma's experts do not need (docs/megatron.md), and
    TEGroupedMLP pads its own tokens (Fp8Padding)."""
    settings = dict(transformer_impl=args.transformer_impl, moe_shared_expert_intermediate_size=args.shared_expert_ffn,
                    num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                    qk_layernorm=args.qk_layernorm)
    if args.fp8_format:
        settings.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.moe_permute_fusion:
        settings["moe_permute_fusion"] = True
    if args.gradient_accumulation_fusion:
        settings["gradient_accumulation_fusion"] = True
    if args.transformer_impl == "transformer_engine" and not args.nondeterministic:
        # TE's attention picks deterministic kernels only so (Megatron-LM's --deterministic-mode; preflight sets
        # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, which that mode requires)
        settings["deterministic_mode"] = True
    return settings


def base_layer_spec(args):
    """The layer spec Megatron-LM's `--transformer-impl` picks for the MoE model (Megatron's own experts in it)."""
    if args.transformer_impl == "transformer_engine":
        return mc.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts,
                                                                          moe_grouped_gemm=True,
                                                                          qk_layernorm=args.qk_layernorm)
    return mc.get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=True, qk_layernorm=args.qk_layernorm,
                                       normalization=args.normalization)


def chunk_spec(args, config, layer_spec, vp_stage):
    """What GPTModel builds a model chunk from. TE's spec: the layer spec (TransformerBlock's final norm is TENorm,
    which takes either norm). The local spec: the chunk's layers with the layers' own norm as the final norm, as
    Megatron's block spec builder means to: handed a layer spec, TransformerBlock picks Apex's FusedLayerNorm wherever
    Apex imports, which refuses RMSNorm (Megatron-LM issue #1658; its decoder block spec does the same)."""
    if args.transformer_impl == "transformer_engine":
        return layer_spec
    return mc.TransformerBlockSubmodules(
        layer_specs=[layer_spec] * mc.get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=layer_spec.submodules.input_layernorm)


def recompute_settings(args):
    """The TransformerConfig fields of the run's recompute options (none: Megatron's defaults, no recompute)."""
    if args.recompute_full:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if args.recompute_modules:
        return dict(recompute_granularity="selective", recompute_modules=list(args.recompute_modules))
    return {}


def seed_rng_trackers(args, seed):
    """Megatron's model-parallel RNG trackers from `seed`; graph-safe ones (torch Generators, which a CUDA graph can
    register and a captured `fork()` can use) in a job with --cuda-graph-impl, for every mode of it, so that all of
    them draw the same weights the same way (as Megatron-LM: use_cudagraphable_rng when a graph impl is set)."""
    graphs = args.cuda_graph_impl != "none"
    mc.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graphs, force_reset_rng=graphs)


def build(args, mode):
    """Model chunks (GPT + Float16Module + DDP: one, or --vpp with interleaving) and the optimizer over them, with
    the experts of `mode`, from the run's seed."""
    torch.manual_seed(args.seed)
    seed_rng_trackers(args, args.seed)
    config = mc.TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization=args.normalization,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, init_method_std=0.02, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        moe_grouped_gemm=True,  # as the layer spec below; read only by spec builders and the moe_act check
        cuda_graph_impl="full_iteration" if graphed(args, mode) else "none",
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        **model_settings(args), **recompute_settings(args),
    )
    # the switch: Megatron's own experts of the spec ("megatron", "te") -> megatron_tma's, in either spec
    setattr(config, CONFIG_FLAG, None if mode in MEGATRONS_OWN else mode)
    setattr(config, TRANSPOSE_FLAG, args.transpose_weights_in_backward)
    setattr(config, REFRESH_FLAG, args.step_refreshed_weights)
    setattr(config, RELEASE_FLAG, args.release_bf16_expert_weights)
    spec = mc.layer_spec_from_config(base_layer_spec(args), config)
    gpts = []
    for vp in range(args.vpp) if args.vpp else [None]:
        first = mc.parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        last = mc.parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        gpts.append(mc.GPTModel(config=config, transformer_layer_spec=chunk_spec(args, config, spec, vp),
                                vocab_size=args.vocab,
                                max_sequence_length=args.seq_len, position_embedding_type="rope",
                                pre_process=first, post_process=last, vp_stage=vp).cuda())
    if mode in MEGATRONS_OWN:
        redraw_megatron_experts(args, gpts, config)
    # as Megatron-LM: the chunks after the first keep all their parameters in one bucket; with the full-iteration
    # graph DDP is built on the capture stream, as Megatron-LM does, so that the AccumulateGrad nodes it keeps do not
    # name a stream the capture does not run on
    stream = mc.get_shared_capture_stream() if graphed(args, mode) else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        models = [mc.DistributedDataParallel(config, mc.DistributedDataParallelConfig(**ddp_settings(args)),
                                             mc.Float16Module(config, gpt), disable_bucketing=i > 0)
                  for i, gpt in enumerate(gpts)]
    torch.cuda.current_stream().wait_stream(stream)
    config.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
    config.finalize_model_grads_func = mc.finalize_model_grads
    if args.defer_expert_wgrad:  # (after the finalize it wraps; Megatron's own and the BF16 experts are left alone)
        defer_expert_wgrads(models, config)
    optimizer = mc.get_megatron_optimizer(
        mc.OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0,
                           bf16=True, use_distributed_optimizer=args.distributed_optimizer),
        models)
    if args.release_bf16_expert_weights:  # its copy of the main params writes released experts' FP8 copies
        attach_optimizer(optimizer)
    return models, optimizer


def expert_weights_of(experts, name):
    """The per-expert `[N, K]` weights of linear `name` of Megatron's own experts, in expert order: SequentialMLP's
    `local_experts[i].<name>.weight`, TEGroupedMLP's `<name>.weight{i}` (TE's GroupedLinear)."""
    if hasattr(experts, "local_experts"):
        return [getattr(e, name).weight for e in experts.local_experts]
    linear = getattr(experts, name)
    return [getattr(linear, f"weight{i}") for i in range(experts.num_local_experts)]


def redraw_megatron_experts(args, gpts, config):
    """Give Megatron's own experts (SequentialMLP, or TEGroupedMLP under TE's spec) the initial weights megatron_tma's
    experts draw: from the freshly seeded expert-parallel RNG state, chunk by chunk and layer by layer (the order
    they were built in), every expert's fc1 then every expert's fc2 (Megatron's experts draw expert by expert, and
    TE's GroupedLinear in its own RNG order). The dense layers are already built; re-seeding only restarts the
    tracker's streams."""
    seed_rng_trackers(args, args.seed)
    with torch.no_grad(), mc.get_cuda_rng_tracker().fork(mc.get_expert_parallel_rng_tracker_name()):
        for layer in (layer for gpt in gpts for layer in gpt.decoder.layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            for w in expert_weights_of(experts, "linear_fc1"):
                config.init_method(w)
            for w in expert_weights_of(experts, "linear_fc2"):
                config.output_layer_init_method(w)


def experts_against_megatron(gpt, seed):
    """megatron_tma's experts (BF16 and unpadded FP8) given the weights of the first layer's Megatron experts
    (SequentialMLP; or TEGroupedMLP, mode `te`), on the same routed tokens: the diff of docs/design.md §3 of each
    output against Megatron's, in float64. Everything runs under Megatron's FP8 context when the config sets FP8 (as
    in training: TEGroupedMLP then computes in TE's FP8 recipe, ours are unaffected by it). Against SequentialMLP,
    BF16 must compute Megatron's function (diff at rounding level), FP8 within its recipe's noise; against TE's FP8
    experts, both within FP8 noise."""
    theirs = gpt.decoder.layers[0].mlp.experts
    state = {}
    for k, v in theirs.state_dict().items():
        key = from_sequential_mlp_key(k) or (k if re.fullmatch(r"linear_fc[12]\.weight\d+", k) else None)
        if key:  # SequentialMLP's keys renamed; TEGroupedMLP has megatron_tma's keys already (not its _extra_state)
            state[key] = v
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = theirs.num_local_experts
    sizes = torch.randint(0, 400, (n,), generator=g, device="cuda")
    x = torch.randn(int(sizes.sum()), gpt.config.hidden_size, generator=g, device="cuda").bfloat16()
    probs = torch.rand(x.shape[0], generator=g, device="cuda")
    with torch.no_grad(), fp8_context(gpt.config):
        ref = theirs(x, sizes.cpu(), probs)[0].double()
        diffs = {}
        for mode in ("bf16", "unpadded"):
            ours = megatron_experts(n, gpt.config, mode=mode)
            ours.load_state_dict(state)
            out = ours(x, sizes, probs)[0].double()
            diffs[mode] = float(1 - 2 * (out * ref).sum() / ((out * out).sum() + (ref * ref).sum()))
    return diffs


def fp8_context(config):
    """Megatron's own FP8 context for the whole model (`fp8_utils.get_fp8_context`), a null context without FP8."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config)


def chunk_prefixes(models):
    """(name prefix, chunk): no prefix for a single chunk, `chunk<i>.` with virtual pipeline stages."""
    return [("" if len(models) == 1 else f"chunk{i}.", m) for i, m in enumerate(models)]


def canonical_weights(models):
    """(name, tensor) of the model chunks' weights under megatron_tma's state-dict keys (SequentialMLP's per-expert
    MLPs renamed): what every mode must start from."""
    for prefix, model in chunk_prefixes(models):
        for key, value in model.state_dict().items():
            # TE modules' `_extra_state` (their FP8 metadata, serialized) is not a weight: Megatron's own TE experts
            # have one per linear, megatron_tma's none
            if isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
                yield prefix + (from_sequential_mlp_key(key) or key), value


def named_parameters(models):
    for prefix, model in chunk_prefixes(models):
        for name, param in model.named_parameters():
            yield prefix + name, param


def optimizer_class(optimizer):
    """`module.Class` of the torch optimizer inside Megatron's optimizer (chained, mixed-precision or distributed)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    inner = getattr(inner, "optimizer", inner)
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


def norm_classes(models):
    """`module.Class` of every normalization module in the model chunks (Apex's FusedLayerNorm in the local spec where
    Apex imports, torch's norm otherwise, TE's in TE's spec): which kernels the run's layer norms were."""
    return sorted({f"{type(m).__module__}.{type(m).__qualname__}" for model in models for m in model.modules()
                   if "norm" in type(m).__name__.lower()})
