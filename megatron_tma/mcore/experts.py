"""Megatron-core MoE experts on megatron_tma's expert MLPs: what `MoELayer` builds when a layer spec asks for them.

`megatron_experts(num_local_experts, config, pg_collection=..., name=..., mode=...)` has the signature of Megatron's
experts builders (`ExpertsBuilder` in `megatron/core/transformer/moe/moe_layer.py`) and returns an expert MLP with
`TEGroupedMLP`'s forward contract: `(permuted tokens [T, H], tokens per local expert [G], permuted probs [T]) ->
(out [T, H], None)`. The modes (`megatron_tma.mcore.config.MODES`):
* `"unpadded"`: `megatron_tma.mlp.GroupedFP8MLP`, the FP8 blockwise recipe of docs/design.md without padding; this is
  what replaces Megatron's padded FP8 expert path (`TEGroupedMLP` behind `Fp8Padding`, 16 rows per expert);
* `"padded16"`, `"padded128"`: its padded twin, the same FP8 Functions on every expert padded to 16 / 128 rows
  (Transformer Engine's and DeepGEMM's alignments): equal to `"unpadded"` bit for bit, which the recipe checks;
* `"bf16"`: the same MLP with BF16 `torch._grouped_mm` GEMMs.

What the Megatron side needs, and where it is done here:
* Parameters: one `[G, N, K]` BF16 weight per linear (`linear_fc1.weight`, `linear_fc2.weight`), initialized expert
  by expert with `config.init_method` / `config.output_layer_init_method` under the expert-parallel RNG tracker, as
  Megatron's expert linears are; the state dict has Transformer Engine's keys `linear_fc{1,2}.weight{i}`.
  `allreduce` is False when expert parallelism is on, so that Megatron's DDP reduces their gradients over the
  expert-data-parallel group, as it does for its own experts.
* Gradients: into `main_grad` when Megatron's DDP gives the weight one (the K-grouped GEMM accumulates into the
  FP32 buffer), with `grad_added_to_main_grad` set and a dummy gradient for DDP's hooks, which need one when they
  overlap the gradient reduction (megatron_tma.autograd).
* The FP8 weight cache. Megatron's optimizers write the new weights through `param.data` (or into the DDP buffer
  the parameters view), which no version counter sees, and Megatron sets `is_first_microbatch` only when
  `config.fp8` is set (Transformer Engine's FP8). So the cache here is invalidated by Megatron's own per-iteration
  signal: `DistributedDataParallel.zero_grad_buffer()` resets `grad_added_to_main_grad` to False on every weight at
  the start of each iteration, and the backward sets it to True. A forward that finds it False after a backward has
  reached the experts re-quantizes; the other forwards with it False (a pipeline's warm-up micro-batches, a
  recompute in backward) keep the copies, which all micro-batches in flight then share. So does the first forward
  after any torch optimizer step in the process (a global post-step hook): Megatron's evaluation runs after a step
  without resetting the flag. Weights without
  the attribute (no Megatron DDP) rely on the version counter, which PyTorch's optimizers do move;
  `invalidate_fp8_weights(model)` is there for any other update path.
* Megatron's distributed checkpoint (`sharded_state_dict`): the shards and objects Megatron's own experts write, so
  that checkpoints go both ways between these experts and Megatron's (tests/test_mcore.py: equal to `SequentialMLP`'s
  entry for entry, and `torch_dist` saves and loads through Megatron's writer in both directions: on the CPU with
  its two CUDA calls stood in for, on the H200 as is), optimizer state included: each weight parameter is one
  factory over the parameter itself, which Megatron's optimizers need to find their states (docs/megatron.md).
* Warned about, not refused: Megatron's training CUDA graphs around these experts (`cuda_graph_impl`), untested end
  to end. The cache above is host logic that a replay skips, so a forward under graph capture always quantizes the
  weights inside the graph (every replay re-quantizes from the weights' memory, which Megatron updates in place).
* Megatron's `recompute_modules=["moe_act"]` (selective recompute): the FP8 experts then recompute the activation
  in backward instead of keeping its FP8 columns (`recompute_activation`, megatron_tma.activation_linear), with the
  same bits; the BF16 experts warn that they do not.
* `moe_apply_probs_on_input` (top-1 only, as Megatron): the probs scale the experts' input instead of the
  activation's output, as Megatron's experts compute it.
* Expert tensor parallelism (`expert_tensor_parallel_size` > 1): each rank holds Megatron's shard of every expert
  (fc1's gate and up rows, fc2's columns; `moe_ffn_hidden_size / ETP` a multiple of 128) and the parameters are
  marked split (`tensor_model_parallel`, as Megatron's expert linears); Megatron's dispatcher gathers the tokens
  and adds up the partial outputs. Shards and checkpoint entries equal SequentialMLP's on the CPU; on two H200s
  the recipe at ETP = 2 trains unpadded == padded16 (tests/test_mcore_gpu.py, expert tensor parallelism test).
Not implemented (refused with the config field named): biases, expert GTP weight sharding, latent projections,
clamped or offset GLUs, a deferred weight gradient (`delay_wgrad_compute`,
`overlap_dispatch_backward_with_experts_wgrad`: Megatron would call `backward_dw()`).
Megatron is imported only to initialize the weights under its RNG tracker (`config.perform_initialization`), so the
module itself runs, and is tested, without it.
"""
import functools
import warnings
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._ext import check_backend, warn_if_reference_on_gpu
from ..activation import GATED
from ..mlp import GroupedBF16MLP, GroupedFP8MLP, capturing
from ..released_weights import materialize_bf16_weights
from .config import REFRESH_FLAG, RELEASE_FLAG, TRANSPOSE_FLAG, expert_mlp_args, expert_tensor_parallel_size, pad_to_of

__all__ = ["megatron_experts", "MegatronFP8Experts", "MegatronBF16Experts", "invalidate_fp8_weights"]


_EXTRA_STATE = "_extra_state"


class _MegatronExperts:
    """What Megatron asks of an experts module beyond the MLP itself (mixed into the two MLP classes)."""

    def _setup_for_megatron(self, config) -> None:
        self.config = config
        self._register_load_state_dict_pre_hook(self._drop_extra_states)
        if getattr(config, "perform_initialization", True):
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

            # Megatron initializes expert weights under the expert-parallel RNG state, so that expert-parallel ranks
            # draw different experts and the dense layers stay identical across them.
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                self.linear_fc1.reset_parameters(config.init_method)
                self.linear_fc2.reset_parameters(config.output_layer_init_method)
        expert_pgs = (getattr(config, "expert_model_parallel_size", 1) or 1) > 1 or (
            expert_tensor_parallel_size(config) != (getattr(config, "tensor_model_parallel_size", 1) or 1))
        for parallel_dim, linear in ((0, self.linear_fc1), (1, self.linear_fc2)):
            for param in linear.parameters():
                param.allreduce = not expert_pgs  # Megatron's mark: reduce over the expert-data-parallel group
                # Split over the expert-tensor-parallel ranks as Megatron's expert linears are, and marked so at any
                # size as theirs are (its gradient norm counts a marked parameter on every tensor-parallel rank):
                # fc1 along its outputs (column parallel), fc2 along its inputs (row parallel); in a stacked
                # [G, N, K] weight those are dims 1 and 2.
                param.tensor_model_parallel, param.partition_stride = True, 1
                param.partition_dim = parallel_dim + param.dim() - 2

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: Optional[torch.Tensor] = None, **kwargs):
        unsupported = {k: v for k, v in kwargs.items() if v is not None}
        if unsupported:
            raise NotImplementedError(
                f"megatron_tma experts do not take {', '.join(sorted(unsupported))} (Transformer Engine's fused "
                "op path and inference routing)"
            )
        x = permuted_local_hidden_states
        # Set by the dispatcher that megatron_tma.mcore.experts_permutation patched, for this one forward: x is then
        # the routed tokens in their own order, and the output goes back to them combined.
        permutation, self._pending_permutation = getattr(self, "_pending_permutation", None), None
        if permutation is not None:
            if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device != x.device:
                tokens_per_expert = tokens_per_expert.to(x.device, non_blocking=True)
            return super().forward(x, tokens_per_expert, permuted_probs, permutation=permutation)
        if getattr(self.config, "moe_apply_probs_on_input", False) and permuted_probs is not None:
            # Megatron's top-1 option: the probs scale the input (FP32 product, one rounding to x's dtype), and the
            # activation then multiplies by nothing; the padded twins get the same scaled rows, so the bits agree
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = None
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device != x.device:
            # Megatron's dispatchers may keep the counts on the host; the kernels read them on the device only.
            tokens_per_expert = tokens_per_expert.to(x.device, non_blocking=True)
        return super().forward(x, tokens_per_expert, permuted_probs)

    def backward_dw(self) -> None:
        raise NotImplementedError("megatron_tma experts compute weight gradients in the backward itself "
                                  "(config.delay_wgrad_compute is not supported)")

    def _expert_groups(self):
        """(expert-parallel, expert-data-parallel, expert-tensor-parallel) process groups."""
        pgs = getattr(self, "_pg_collection", None)
        if pgs is not None:
            return pgs.ep, pgs.expt_dp, pgs.expt_tp
        from megatron.core import parallel_state as ps

        return (ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group(),
                ps.get_expert_tensor_parallel_group())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's distributed checkpoint of the experts, laid out as Megatron's own experts lay theirs out
        (`SequentialMLP`; `TEGroupedMLP` matches it, says its docstring, not checked here): per local expert, its
        fc1 / fc2 weight as a shard of `<prefix>experts.linear_fc{1,2}.weight` along a global expert axis (SwiGLU's
        fc1 split into its gate and up halves as Megatron's factory splits it), replicated over the
        expert-data-parallel group, and each linear's `_extra_state` object (None) that Megatron's experts read back.

        Each weight parameter is one `ShardedTensorFactory` whose `data` is the parameter itself: Megatron's
        optimizers find a parameter's checkpoint entry by the identity of that tensor (`get_param_id_to_sharded_
        param_map`, the distributed optimizer's `param_to_sharded_metadata`), and then build the optimizer state's
        entries (FP32 master weights, Adam's moments) with the same factory from a tensor of the parameter's shape.
        So a stacked `[G, N, K]` parameter writes G per-expert shards for the weights and for each optimizer state,
        and loads back as one `[G, N, K]` tensor under its own key (`linear_fc{1,2}.weight`; `_GroupedWeights`
        loads it). Views of the parameter in its place would leave the optimizer's states without an entry."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        materialize_bf16_weights(self.parameters())  # (release_bf16_weights: the entries' data are the parameters)
        singleton = metadata.get("singleton_local_shards", False)
        ep, expt_dp, expt_tp = self._expert_groups()
        num_global, first = ep.size() * self.num_experts, ep.rank() * self.num_experts

        def offsets_of(i):  # expert i's offsets: a shard of the global expert axis (none for singleton shards)
            return sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), first + i, num_global))

        offsets_of.first = first

        out = {}
        for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
            for i in range(self.num_experts):
                # A Megatron linear's `_extra_state` (None for its local linears), which its experts expect to find
                sharded_prefix = f"{prefix}experts.{first + i}." if singleton else f"{prefix}experts."
                extra = make_sharded_tensors_for_checkpoint({_EXTRA_STATE: None}, sharded_prefix + f"{name}.", {},
                                                            offsets_of(i), tp_group=expt_tp,
                                                            dp_cp_group=metadata["dp_cp_group"])[
                    f"{sharded_prefix}{name}.{_EXTRA_STATE}"]
                extra.replica_id = (*extra.replica_id[:2], expt_dp.rank())  # replicated over expert DP
                out[f"{prefix}{name}.{_EXTRA_STATE}{i}"] = extra
            for param_name, param in linear.named_parameters(recurse=False):
                experts = range(self.num_experts) if param.dim() == 3 else [int(param_name[len("weight"):])]
                out[f"{prefix}{name}.{param_name}"] = ShardedTensorFactory(
                    f"{prefix}experts.{name}.weight", param,
                    self._expert_shards_fn(name, experts, offsets_of, metadata, singleton),
                    functools.partial(_merge_expert_shards, stacked=param.dim() == 3),
                    replica_id=(0, 0, expt_dp.rank()))
        return out

    def _expert_shards_fn(self, name, experts, offsets_of, metadata, singleton):
        """The factory's build function: the per-expert shards of a tensor shaped like the weight parameter (the
        weight itself, or an optimizer state of it) under the factory's key as it is then (Megatron renames it after
        this module built it: the layer number becomes an axis, the optimizer prefixes its state's name)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        _, _, expt_tp = self._expert_groups()
        gated, tp_axis = name == "linear_fc1" and self.activation in GATED, 0 if name == "linear_fc1" else 1
        tail = f"experts.{name}.weight"

        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            if flattened_range is not None:  # the distributed optimizer's deprecated fully_sharded_model_space
                raise NotImplementedError(
                    f"{key}: flattened optimizer-state shards (the distributed optimizer's 'fully_sharded_model_space' "
                    "format) are not supported by megatron-core's ShardedTensor either; save with 'dp_reshardable' or "
                    "'fully_reshardable'")
            if not key.endswith(tail):
                raise ValueError(f"expected a key ending in {tail!r}, got {key!r}")
            head = key[: len(key) - len(tail)]
            shards = []
            for i, w in zip(experts, t.unbind(0) if t.dim() == 3 else [t]):
                offsets = offsets_of(i)
                sharded_prefix = f"{head}experts.{offsets_of.first + i}." if singleton else f"{head}experts."
                sh = make_sharded_tensors_for_checkpoint({"weight": w}, f"{sharded_prefix}{name}.", {"weight": tp_axis},
                                                         offsets, tp_group=expt_tp,
                                                         dp_cp_group=metadata["dp_cp_group"])[
                    f"{sharded_prefix}{name}.weight"]
                if gated:  # Megatron's SwiGLU factory: the gate and up halves as two shards
                    sh = apply_swiglu_sharded_factory(sh, offsets, singleton, tp_group=expt_tp,
                                                      dp_group=metadata["dp_cp_group"]).build()
                for piece in sh if gated else [sh]:
                    piece.replica_id = replica_id
                shards.append(sh)
            return shards

        return build

    def _drop_extra_states(self, state_dict, prefix, *args):
        """A load pre-hook: the `_extra_state{i}` entries a distributed checkpoint hands back (None, Megatron's
        linears' state) have nothing to load into here."""
        for name in ("linear_fc1", "linear_fc2"):
            for i in range(self.num_experts):
                state_dict.pop(f"{prefix}{name}.{_EXTRA_STATE}{i}", None)


_optimizer_steps = 0  # optimizer steps taken in this process (any torch.optim.Optimizer), see _watch_optimizer_steps
_optimizer_hook = None


def _merge_expert_shards(loaded, stacked: bool):
    """The factory's merge function: the loaded per-expert tensors (SwiGLU's fc1 as its two halves) back into one
    tensor shaped like the parameter (`[G, N, K]`, or `[N, K]` for one expert's parameter)."""
    experts = [torch.cat(e) if isinstance(e, list) else e for e in loaded]
    return torch.stack(experts) if stacked else experts[0]


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    """Count every torch optimizer step in the process (a global post-step hook, registered once). Megatron's
    optimizers step a torch optimizer (Adam / SGD, fused or not) and then copy the new weights into the parameters
    through `.data`; the next forward of the experts sees the count moved and re-quantizes. That covers what DDP's
    per-iteration flag misses: a forward after a step but before the next iteration's `zero_grad_buffer()`, i.e.
    Megatron's evaluation, which would otherwise run on the FP8 copies of the weights before the step."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_count_optimizer_step)


class MegatronFP8Experts(_MegatronExperts, GroupedFP8MLP):
    """The unpadded FP8 expert MLP (or its padded twin) as Megatron experts; see the module docstring."""

    _steps_seen = None  # the optimizer step count at this module's last forward
    _backward_since_quantized = False  # a backward reached these experts since their FP8 copies were made

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs=None, **kwargs):
        # The weights may have been written through .data, which no version counter sees, after an optimizer step
        # (any, since the last forward) or when DDP's per-iteration reset left the flag False after a backward ran
        # (a new iteration). Forwards with the flag False and no backward since the copies were made -- a
        # pipeline's warm-up micro-batches, a recompute in backward -- keep them: re-making them there would also
        # keep one more FP8 copy of the weights alive per micro-batch in flight (each holds its W^T for dgrad).
        # Under CUDA-graph capture (Megatron's cuda_graph_impl) the linears quantize inside the graph themselves
        # (GroupedFP8Linear.graph_reuses_cached_weights), or with step-refreshed weights a kernel decides at each
        # replay whether a step came (megatron_tma.weight_refresh): these host checks do not run at replay, and an
        # invalidation captured here would re-quantize at every replay.
        stepped = self._steps_seen != _optimizer_steps
        self._steps_seen = _optimizer_steps
        reset = self._backward_since_quantized and any(
            getattr(w, "grad_added_to_main_grad", None) is False for w in self.parameters())
        if (stepped or reset) and not (self.linear_fc1.step_refreshed_weights and capturing()):
            self.invalidate_weight_cache()
            self._backward_since_quantized = False
        out, bias = super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs)
        if out.requires_grad:
            out.register_hook(self._note_backward)
        return out, bias

    def _note_backward(self, grad):
        self._backward_since_quantized = True


class MegatronBF16Experts(_MegatronExperts, GroupedBF16MLP):
    """The same expert MLP with BF16 GEMMs, as Megatron experts."""


def _ignored_settings(config, mode: str):
    """Messages for Megatron settings that would not do here what they do for Megatron's own experts: the results
    stay right, but the user asked for something (padding, memory savings) they do not get."""
    if mode != "bf16" and (getattr(config, "moe_router_padding_for_quantization", False)
                           or getattr(config, "moe_router_padding_for_fp8", False)):
        # Megatron's router then gives every expert extra zero-prob tokens up to a multiple of 16 / 32: the padding
        # these experts exist to remove, paid in routed tokens and GEMM work instead of copies
        yield ("config.moe_router_padding_for_quantization pads every expert's tokens for FP8; megatron_tma's "
               "experts need no padding: turn it off")
    if mode != "bf16" and _dispatcher_pads_for_quantization(config):
        # megatron-core 0.19.2's flex dispatcher with HybridEP or NCCL-EP packs every expert's received tokens to
        # get_align_size_for_quantization(config) rows (16 / 32 for FP8, 256 with TE's op fuser) whenever fp8 or
        # fp4 is set (token_dispatcher.py: _HybridEPManager.dispatch's pad_multiple, _NCCLEPManager's alignment)
        yield (f"config.moe_flex_dispatcher_backend={config.moe_flex_dispatcher_backend!r} with config.fp8 set pads "
               "every expert's tokens to the FP8 alignment in the dispatcher; megatron_tma's experts need no "
               "padding and compute the padded rows as tokens (right results, wasted work): use the alltoall "
               "dispatcher")
    if mode == "bf16" and _recomputes_activation(config):
        yield ("config.recompute_modules has 'moe_act', which megatron_tma's BF16 experts do not implement (its FP8 "
               "experts do): they keep the activation output for backward")
    if getattr(config, "fine_grained_activation_offloading", False):
        asked = [m for m in ("expert_fc1", "moe_act", "fused_group_mlp") if m in (config.offload_modules or [])]
        if asked:
            yield (f"config.offload_modules has {asked}, which megatron_tma's experts do not implement: their saved "
                   "activations stay on the GPU")
    if mode != "bf16" and _graphs_capture_experts(config):
        yield (f"config.cuda_graph_impl={config.cuda_graph_impl!r} captures megatron_tma's FP8 experts in CUDA graphs, "
               "which is untested end to end in Megatron: a captured forward quantizes the weights inside the graph "
               "(every replay re-quantizes them, as the first micro-batch of a step does), since the host-side "
               "checks that otherwise decide when to re-quantize do not run at replay")


def _dispatcher_pads_for_quantization(config) -> bool:
    """Megatron's token dispatcher pads every expert's tokens for FP8 / FP4 on its own (not only when asked with
    moe_router_padding_for_quantization): the flex dispatcher with HybridEP or NCCL-EP under fp8 / fp4."""
    return (bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))
            and getattr(config, "moe_token_dispatcher_type", None) == "flex"
            and getattr(config, "moe_flex_dispatcher_backend", None) in ("hybridep", "ncclep"))


def _graphs_capture_experts(config) -> bool:
    """Megatron's training CUDA graphs with the MoE layer's experts inside: the full iteration, or per-layer graphs
    of the whole layer (no modules listed, or "full") or of its MLP part ("moe")."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "full_iteration":
        return True
    if impl not in ("local", "transformer_engine"):
        return False
    modules = getattr(config, "cuda_graph_modules", None)
    modules = [modules] if isinstance(modules, str) or modules is None else list(modules)
    names = {str(getattr(m, "name", m)).lower() for m in modules if m is not None}
    return not names or bool(names & {"full", "moe"})


def _recomputes_activation(config) -> bool:
    """Megatron's selective recompute of the experts' activation (`--recompute-modules moe_act`)."""
    return getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in (
        getattr(config, "recompute_modules", None) or [])


def megatron_experts(num_local_experts: int, config, *, pg_collection=None, name: Optional[str] = None,
                     mode: str = "unpadded", backend: str = "auto"):
    """Megatron's experts builder signature (`MoESubmodules.experts`); `mode` picks the MLP (module docstring)."""
    del name
    check_backend(backend)  # before warn_if_reference_on_gpu reads it
    pad_to = pad_to_of(mode)
    args = expert_mlp_args(config)
    device = "cpu" if getattr(config, "use_cpu_initialization", False) else torch.cuda.current_device()
    warn_if_reference_on_gpu(backend, device)
    for message in _ignored_settings(config, mode):
        warnings.warn(message, UserWarning, stacklevel=2)
    _watch_optimizer_steps()
    if mode == "bf16":
        module = MegatronBF16Experts(num_local_experts, *args, backend=backend, device=device)
    else:
        transpose, refresh, release = (_bool_flag(config, flag) for flag in (TRANSPOSE_FLAG, REFRESH_FLAG,
                                                                             RELEASE_FLAG))
        module = MegatronFP8Experts(num_local_experts, *args, pad_to=pad_to, backend=backend, device=device,
                                    recompute_activation=_recomputes_activation(config),
                                    keep_transposed_weight=not transpose, step_refreshed_weights=refresh,
                                    release_bf16_weights=release)
    module._setup_for_megatron(config)
    module._pg_collection = pg_collection  # the expert process groups, for the distributed checkpoint
    return module


def _bool_flag(config, flag: str) -> bool:
    value = getattr(config, flag, False)
    if not isinstance(value, bool):
        raise TypeError(f"config.{flag} must be a bool, got {type(value).__name__} {value!r}")
    return value


def invalidate_fp8_weights(model: torch.nn.Module) -> int:
    """Make every megatron_tma FP8 expert module in `model` re-quantize its weights in its next forward (for weight
    updates that neither Megatron's DDP signal nor a version counter shows). Returns how many it found."""
    found = 0
    for module in model.modules():
        if isinstance(module, GroupedFP8MLP):
            module.invalidate_weight_cache()
            found += 1
    return found
