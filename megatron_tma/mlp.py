"""The expert MLP of a Mixture-of-Experts layer on unpadded FP8 grouped GEMMs, and its two baselines.

`GroupedFP8MLP(num_experts, hidden_size, ffn_hidden_size, activation)` takes what Megatron's token dispatcher
hands its experts -- the permuted tokens `[T, H]`, the tokens per expert (here a device int tensor `[G]`, never
read on the host) and the permuted routing probs `[T]` -- and returns `(out, None)` like Megatron's
`TEGroupedMLP.forward`:

    h = fc1(x)                      FP8 grouped linear, [T, H] -> [T, 2F] (SwiGLU) or [T, F]
    z = act(h) * probs              in FP32 from the BF16 h, rounded once to BF16 (SwiGLU: silu(h[:, :F]) * h[:, F:],
                                    GeGLU: gelu(h[:, :F]) * h[:, F:], the gate half first, as Megatron);
                                    megatron_tma.activation, one fused CUDA kernel each way on Hopper
    out = fc2(z)                    FP8 grouped linear, [T, F] -> [T, H]

Two parameter layouts (`weight_layout`), the two of Megatron's expert modules:
* `"stacked"` (the default): one parameter per linear, `linear_fc1.weight` `[G, 2F or F, H]` and `linear_fc2.weight`
  `[G, H, F]`, as Megatron's `GroupedMLP` keeps its experts in one tensor (the state dict still has one key per
  expert, below). One autograd leaf per linear: the step's host cost does not grow with the number of experts
  (with G parameters it is ~6 us per expert weight: the engine's AccumulateGrad node, the gradient's split,
  `zero_grad`), which is what keeps many-expert layers (G = 128) GPU-bound. A Megatron `main_grad` is then one
  `[G, N, K]` FP32 buffer that wgrad accumulates into.
* `"per_expert"`: `linear_fc1.weight{i}` `[2F or F, H]` and `linear_fc2.weight{i}` `[H, F]`, one parameter per expert,
  as Transformer Engine's `GroupedLinear` (Megatron's `TEGroupedMLP`), for code that wants a parameter per expert.
  Each linear allocates its G weights as consecutive slices of one storage, so that the FP8 path stacks them for
  free (megatron_tma.autograd); moving the module with `.to()` re-allocates them one by one, which stays correct
  but costs one stacking copy per weight version: build it on its device instead (`device=`).
Both layouts save and load the same state dict, Transformer Engine's keys `linear_fc1.weight{i}` `[2F or F, H]` and
`linear_fc2.weight{i}` `[H, F]` (a stacked module saves its parameter's G slices and copies G tensors into it), so
checkpoints stay interchangeable between the layouts and with `TEGroupedMLP`. Both initialize expert by expert
(`init_method` sees `[N, K]` tensors), so the same seed gives the same weights.

The step is planned once per call (megatron_tma.mlp_function): this module's one check of its inputs stands for the
public entries' own (`fp8_grouped_linear` twice, `activation_times_probs`), and two autograd nodes run their kernels
(fc1 with the activation, whose backward frees dh, h and x's columns as it goes: megatron_tma.linear_activation;
fc2): the same kernels and bits, a lower backward peak, less host time per step (the eager step on fine-grained
experts is host-bound). The public entries run instead under torch.compile, with
`recompute_activation`, when a hook is registered on a linear (calling the linears as modules runs it: Megatron's
parameter all-gather waits in a forward pre-hook), or with `planned_step = False`.

`recompute_activation=True` (Megatron's `recompute_modules=["moe_act"]`) keeps h instead of the FP8 columns of
`act(h) * probs` for backward and recomputes them there: F bytes less per routed token, the same bits
(megatron_tma.activation_linear).

`keep_transposed_weight=False` keeps only W's FP8 copy between a layer's forward and its backward, which then makes
W^T's copy by transposing it (the same bytes and scales: bit for bit what the quantizer writes): one layer's W^T
alive at a time instead of every layer's across the step, for a 1-byte-per-weight transpose in each backward.

`defer_wgrad=True` keeps each backward's weight-gradient operands (FP8 token columns of dY and X) instead of computing
the gradient, and `flush_wgrad()` computes all pending ones in one K-grouped GEMM per linear (megatron_tma.
wgrad_deferral): with gradient accumulation, one pass over the FP32 `main_grad` a step instead of one a micro-batch.

`step_refreshed_weights=True` keeps the FP8 weight copies in fixed buffers that a kernel refreshes on the device only
after an optimizer step (megatron_tma.weight_refresh): a CUDA graph of the layer then replays micro-batches 2..N of a
step without the weight pass, and a replay after a step re-quantizes, with no host check at replay. Run one eager
forward before capturing (the buffers are made there).

`release_bf16_weights=True` frees the BF16 weights' memory once the first training forward has quantized them and
holds the FP8 copies, which each optimizer step then writes straight from its FP32 masters (megatron_tma.
released_weights): 2 bytes per weight instead of 4, at the optimizer step too. It needs an optimizer with FP32
masters that rewrites them (Megatron's mixed-precision one, `released_weights.attach_optimizer`); eager only.

`pad_to=128` or `16` gives the padded twin: every expert's rows are padded with zero rows to a multiple of
`pad_to` (DeepGEMM's and Transformer Engine's alignments), the same FP8 Functions run on the padded layout, and the
padding rows are dropped at the end. Zero rows quantize to zero, so this is exactly the padded GEMM layout of
docs/design.md §3, and the twin is the baseline and the bit-exactness oracle of the unpadded module. On the CUDA
kernels the padded buffers have `padding.padded_row_count_upper_bound` rows (no host read); the rows past the
real padded total belong to no expert and are never read. With the reference backend, which reads the sizes on the
host anyway, they have exactly the padded total.

`GroupedBF16MLP` is the same layer with BF16 `torch._grouped_mm` GEMMs (PyTorch's own autograd) and the same
activation, for comparison.

Megatron integration: the FP8 weight copies are cached per weight version and optimizer step (any torch optimizer's,
fused ones included: megatron_tma.autograd's FP8WeightCache); Megatron's `set_is_first_microbatch()`
sets `is_first_microbatch` on every module that has it (as for Transformer Engine), and the linears here then
re-quantize, which also covers weight updates the version counter cannot see (megatron_tma.autograd). Weights with
a `main_grad` get their gradient accumulated there.
"""
import functools
import warnings
from typing import Callable, List, Optional, Union

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from . import _ext, ops
from ._validate import check_bool, check_int, check_same_device, check_tensor, misalignment16
from .activation import ACTIVATIONS, GATED, activation_times_probs
from .activation_linear import fp8_activation_grouped_linear
from .autograd import FP8WeightCache, flush_wgrad, fp8_grouped_linear, quantized_weights, stack_weights, stacked_view
from .groups import Groups, check_groups, padded_sizes, sizes_to_offsets
from .limits import check_num_experts
from .mlp_function import MlpPlan, fp8_expert_mlp
from .padding import padded_row_count_upper_bound
from .permutation import Permutation, check_permutation, combine_rows, gather_rows
from .released_weights import ReleasedBF16Weights, materialize_bf16_weights, restore_bf16_weights
from .weight_refresh import StepRefreshedWeights
from .wgrad_deferral import WgradDeferral

__all__ = ["ACTIVATIONS", "GroupedFP8MLP", "GroupedBF16MLP", "GroupedFP8Linear", "GroupedBF16Linear",
           "activation_times_probs", "WEIGHT_LAYOUTS"]

PAD_TO = (None, 16, 128)


# --------------------------------------------------------------------------------------------------------------
# Grouped linears
# --------------------------------------------------------------------------------------------------------------


def _default_init(w: torch.Tensor) -> None:
    nn.init.normal_(w, mean=0.0, std=0.02)  # Megatron's init_method_std


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


WEIGHT_LAYOUTS = ("stacked", "per_expert")


class _GroupedWeights(nn.Module):
    """G expert weights `[out_features, in_features]` in bf16 in one storage: one `weight` parameter
    `[G, out_features, in_features]` (`weight_layout="stacked"`) or G parameters `weight{i}` (`"per_expert"`)."""

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, weight_layout: str = "stacked",
                 device=None, init_method: Optional[Callable[[torch.Tensor], None]] = None):
        super().__init__()
        check_int(num_groups, "num_groups", 1)
        check_int(in_features, "in_features", 1)
        check_int(out_features, "out_features", 1)
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be 'stacked' or 'per_expert', got {weight_layout!r}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.weight_layout = weight_layout
        storage = torch.empty(num_groups, out_features, in_features, dtype=torch.bfloat16, device=device)
        if weight_layout == "stacked":
            self._weight_names = ("weight",)
            self.weight = nn.Parameter(storage)
        else:
            self._weight_names = tuple(f"weight{i}" for i in range(num_groups))
            for name, w in zip(self._weight_names, storage):
                self.register_parameter(name, nn.Parameter(w))
        self.reset_parameters(init_method)

    @property
    def weights(self) -> List[nn.Parameter]:
        """The parameters, as `fp8_grouped_linear` takes them: `[weight]` (`[G, N, K]`) or the G `[N, K]` ones."""
        params = self._parameters  # not getattr: nn.Module's attribute look-up costs microseconds per weight
        return [params[name] for name in self._weight_names]

    def expert_weights(self) -> List[torch.Tensor]:
        """The G `[out_features, in_features]` expert weights, in either layout (slices of `weight` if stacked)."""
        weights = self.weights
        return list(weights[0].unbind(0)) if self.weight_layout == "stacked" else weights

    def expert_grads(self) -> List[Optional[torch.Tensor]]:
        """The G experts' gradients (`.grad`), in either layout (None where there is none)."""
        if self.weight_layout == "stacked":
            grad = self.weights[0].grad
            return [None] * self.num_groups if grad is None else list(grad.unbind(0))
        return [w.grad for w in self.weights]

    def reset_parameters(self, init_method: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        with torch.no_grad():
            for w in self.expert_weights():
                (init_method or _default_init)(w)

    # Checkpoints: both layouts save and load Transformer Engine's keys, `weight{i}` `[N, K]` per expert (checkpoints
    # stay interchangeable with Megatron's own experts), so a stacked module saves its parameter as G slices and loads G tensors
    # into it. Both layouts load alike: missing, unexpected, mis-shaped and non-tensor entries are reported in
    # nn.Module's words, and a linear loads all or nothing (one missing or bad expert entry leaves every expert of
    # that linear as it was, even with strict=False: no half-loaded linear). assign=True makes the checkpoint's
    # tensors the parameters, with their device and dtype (a module built on the meta device comes off it); in the
    # stacked layout the G tensors become one `[G, N, K]` parameter: a view of their memory when they lie back to back
    # in one storage (a stacked module's state dict), else a stacked copy. With torch.__future__'s
    # swap_module_params_on_conversion the parameters are swapped in place, as nn.Module does. A `[G, N, K]` entry
    # under `weight` (in place of the G expert entries) loads as those G entries.

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        cache = getattr(self, "weight_cache", None)
        if isinstance(cache, ReleasedBF16Weights) and not keep_vars:
            # release_bf16_weights: tensors of their own, never views of the parameters' memory, which the next
            # training forward frees (a state dict kept across it would hold freed bytes); while released, the BF16
            # rounding of the master the FP8 copies came from, and the layer stays released
            stacked = cache.bf16_weights() if cache.released else None
            if stacked is None:
                materialize_bf16_weights(self.weights)  # (an error if released with no master)
                stacked = stack_weights([w.detach() for w in self.weights]).clone()
            for i, w in enumerate(stacked.unbind(0)):
                destination[f"{prefix}weight{i}"] = w
            return
        materialize_bf16_weights(self.weights)  # keep_vars: the parameters themselves, written back from the master
        if self.weight_layout == "per_expert":
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = self.weight if keep_vars else self.weight.detach()
        for i, w in enumerate(weight.unbind(0)):  # views: torch.save writes the shared storage once
            destination[f"{prefix}weight{i}"] = w

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for hook in self._load_state_dict_pre_hooks.values():  # as nn.Module does: they may rename or convert keys
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        keys = [f"{prefix}weight{i}" for i in range(self.num_groups)]
        shape = torch.Size((self.out_features, self.in_features))
        stacked = state_dict.get(f"{prefix}weight")
        if (torch.overrides.is_tensor_like(stacked) and stacked.shape == (self.num_groups, *shape)
                and not any(k in state_dict for k in keys)):
            # one [G, N, K] entry under the stacked parameter's own name (what Megatron's distributed checkpoint
            # hands back, megatron_tma.mcore.experts): its G slices are the experts' entries
            del state_dict[f"{prefix}weight"]
            state_dict.update(zip(keys, stacked.unbind(0)))
        values, complete = [], True
        for key in keys:
            if key not in state_dict:
                complete = False
                if strict:  # as nn.Module (load_state_dict always passes strict=True and decides itself)
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                                  f"object from checkpoint but received {type(value)}")
            elif value.shape != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {shape}.")
            else:
                values.append(value)
                continue
            complete = False
        if complete:
            self._load_experts(keys, values, local_metadata.get("assign_to_params_buffers", False), error_msgs)
        if strict:  # as nn.Module: any other key under this module's prefix (it has no submodules)
            own = set(keys)
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in own)

    def _load_experts(self, keys, values, assign: bool, error_msgs) -> None:
        """Copy (or assign, or swap in) the G checked expert tensors of a checkpoint, as nn.Module does per
        parameter."""
        swap = torch.__future__.get_swap_module_params_on_conversion()
        params = self.weights
        if self.weight_layout == "per_expert":
            jobs = [(name, p, v, key) for name, p, v, key in zip(self._weight_names, params, values, keys)]
        elif assign or swap:  # one [G, N, K] parameter made of the G tensors
            stacked_key = keys[0][:-1]  # "<prefix>weight0" -> "<prefix>weight"
            try:
                source = stacked_view(values)
                if source is None:
                    first = values[0]
                    if any(v.dtype != first.dtype or v.device != first.device for v in values):
                        raise ValueError("the experts' tensors differ in dtype or device")
                    source = torch.stack([v.detach() for v in values])
            except Exception as ex:
                error_msgs.append(f'While assigning the parameter named "{stacked_key}" from the experts\' entries '
                                  f"{keys[0]}..{keys[-1]}, an exception occurred : {ex.args}.")
                return
            jobs = [("weight", params[0], source, stacked_key)]
        else:  # copied expert by expert into the slices of the one parameter
            restore_bf16_weights(params)  # (released: the memory back before its views are made)
            jobs = [(None, params[0][i], v, key) for i, (v, key) in enumerate(zip(values, keys))]
        restore_bf16_weights(params)  # released weights get their memory back, written next (and the FP8 copies go)
        for name, param, value, key in jobs:
            if param.is_meta and not value.is_meta and not assign:
                warnings.warn(f"for {key}: copying from a non-meta parameter in the checkpoint to a meta parameter in "
                              "the current model, which is a no-op. (Did you mean to pass `assign=True` to assign "
                              "items in the state dictionary to their corresponding key in the module instead of "
                              "copying them in place?)", stacklevel=3)
            try:
                with torch.no_grad():
                    if name is None or not (assign or swap):
                        param.copy_(value)
                        continue
                    new = param.module_load(value, assign=assign) if swap else value
                    if not isinstance(new, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=param.requires_grad)
                    else:
                        new.requires_grad_(param.requires_grad)
                    if swap:
                        torch.utils.swap_tensors(param, new)
                    else:
                        setattr(self, name, new)
            except Exception as ex:
                error_msgs.append(f'While {"swapping" if swap else "copying"} the parameter named "{key}", whose '
                                  f"dimensions in the model are {param.size()} and whose dimensions in the checkpoint "
                                  f"are {value.size()}, an exception occurred : {ex.args}.")

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_layout={self.weight_layout!r}")


class GroupedFP8Linear(_GroupedWeights):
    """`y[rows of g] = x[rows of g] . weight{g}^T` with the FP8 Function of megatron_tma.autograd."""

    def __init__(self, num_groups, in_features, out_features, *, backend: str = "auto", pow2_scales: bool = False,
                 weight_layout: str = "stacked", device=None, init_method=None,
                 keep_transposed_weight: bool = True, defer_wgrad: bool = False,
                 step_refreshed_weights: bool = False, release_bf16_weights: bool = False):
        # What the FP8 GEMMs take, checked here rather than at the first forward (or, for the group count, at the
        # first backward on a GPU): the same rules on every backend (megatron_tma.limits).
        check_num_experts(num_groups, "num_groups")
        check_int(in_features, "in_features")
        check_int(out_features, "out_features")
        if in_features % 128 or out_features % 128 or in_features <= 0 or out_features <= 0:
            raise ValueError(
                "in_features and out_features must be positive multiples of 128 (the forward contracts over "
                f"in_features and dgrad over out_features in 128-wide FP8 scaling blocks), got {in_features} and "
                f"{out_features}"
            )
        super().__init__(num_groups, in_features, out_features, weight_layout=weight_layout, device=device,
                         init_method=init_method)
        _ext.check_backend(backend)
        check_bool(keep_transposed_weight, "keep_transposed_weight")
        check_bool(defer_wgrad, "defer_wgrad")
        check_bool(step_refreshed_weights, "step_refreshed_weights")
        check_bool(release_bf16_weights, "release_bf16_weights")
        if release_bf16_weights and step_refreshed_weights:
            raise ValueError("release_bf16_weights and step_refreshed_weights exclude each other: the refreshed "
                             "buffers serve CUDA graphs, which a layer that frees and re-allocates its BF16 weights "
                             "cannot be captured in")
        self.backend, self.pow2_scales = backend, pow2_scales
        # True: backward keeps the weight gradient's FP8 operands and flush_wgrad() computes all of them in one GEMM
        # (megatron_tma.wgrad_deferral: one pass over main_grad a step instead of one a micro-batch)
        self.wgrad_deferral = WgradDeferral() if defer_wgrad else None
        # False: the cache holds W's FP8 copy only, and backward makes W^T's from it (the same bits): one layer's
        # W^T at a time instead of every layer's from the forward to the backward (fp8_grouped_linear)
        self.keep_transposed_weight = keep_transposed_weight
        # StepRefreshedWeights: fixed buffers, refreshed by a kernel that skips unless an optimizer step came since
        self.step_refreshed_weights = step_refreshed_weights
        # ReleasedBF16Weights: the BF16 weights' memory freed after the first training forward, the FP8 copies written
        # from the optimizer's FP32 masters at each step (megatron_tma.released_weights)
        self.release_bf16_weights = release_bf16_weights
        self.weight_cache = self._new_cache()
        self.is_first_microbatch = True  # Megatron's flag: re-quantize the weights in the next forward
        # Under CUDA-graph capture the forward quantizes the weights inside the graph, so that every replay reads
        # FP8 copies of the weights as they are then (an optimizer updates them in place; the cache's host-side
        # checks do not run at replay). True makes a capture read the cached copies instead: right only for a graph
        # replayed while the weights do not change (later micro-batches of one step). With step_refreshed_weights the
        # graph decides on the device instead, and this flag is not read.
        self.graph_reuses_cached_weights = False

    def _new_cache(self):
        if self.release_bf16_weights:
            return ReleasedBF16Weights(FP8WeightCache())
        return StepRefreshedWeights() if self.step_refreshed_weights else FP8WeightCache()

    def _replicate_for_data_parallel(self):
        # nn.DataParallel's replicas are shallow copies of this module (its __dict__ copied): each gets a cache of
        # its own, since it holds its device's copies of the weights and runs in a thread of its own.
        if self.release_bf16_weights:
            raise RuntimeError("release_bf16_weights: nn.DataParallel's replicas share the weights whose memory the "
                               "layer frees; build the layer without it")
        replica = super()._replicate_for_data_parallel()
        replica.weight_cache = self._new_cache()
        if self.wgrad_deferral is not None:
            replica.wgrad_deferral = WgradDeferral()
        return replica

    def flush_wgrad(self) -> int:
        """With `defer_wgrad=True`: compute the weight gradients of the backwards since the last flush, in one
        K-grouped GEMM, into `main_grad` (else `.grad`); returns how many backwards that was (0: none pending)."""
        if self.wgrad_deferral is None:
            raise RuntimeError("flush_wgrad: this linear computes its weight gradients in backward (defer_wgrad=False)")
        return flush_wgrad(self.wgrad_deferral, self.weights, self.backend)

    def _cache(self) -> Optional[Union[FP8WeightCache, StepRefreshedWeights]]:
        if torch.compiler.is_compiling():  # no cache in a compiled graph (autograd.quantized_weights says why)
            if self.release_bf16_weights:
                raise RuntimeError("release_bf16_weights: an eager-only layer (a compiled graph quantizes the weights "
                                   "on every call, which their released memory cannot serve)")
            return None
        if self.step_refreshed_weights:
            # Megatron's flag, eagerly: weights may have been written outside an optimizer step (a checkpoint load).
            # Under capture the device counter decides, at every replay, and the flag waits for the next eager call.
            if self.is_first_microbatch and not capturing():
                self.weight_cache.invalidate()
                self.is_first_microbatch = False
            return self.weight_cache
        if self.is_first_microbatch or (not self.graph_reuses_cached_weights and capturing()):
            self.weight_cache.invalidate()
            self.is_first_microbatch = False
        return self.weight_cache

    def forward(self, x: torch.Tensor, groups: torch.Tensor, probs: Optional[torch.Tensor] = None,
                activation: Optional[str] = None, permutation: Optional[Permutation] = None,
                combine: Optional[Permutation] = None) -> torch.Tensor:
        """The layer on x; with `activation`, on `act(x) * probs` computed from x = h here and recomputed in
        backward instead of keeping its FP8 columns (megatron_tma.activation_linear: the same bits, F bytes per row
        less memory); with `permutation`, on the rows `x[permutation.rows]` of the routed tokens x, gathered by the
        quantizer (megatron_tma.permutation); with `combine`, returning the tokens, each the sum of its rows, whose
        gradient's rows backward gathers inside its quantizer. Every way goes through the module call, so that hooks
        on this module (Megatron's parameter all-gather waits in its forward pre-hook) run before the weights are
        read."""
        if activation is None:
            return fp8_grouped_linear(x, self.weights, groups, cache=self._cache(), backend=self.backend,
                                      pow2_scales=self.pow2_scales, permutation=permutation, combine=combine,
                                      keep_transposed_weight=self.keep_transposed_weight,
                                      wgrad_deferral=self.wgrad_deferral)
        if permutation is not None or combine is not None:
            raise ValueError("a linear with an activation (its input is h) takes no permutation or combine")
        return fp8_activation_grouped_linear(x, probs, activation, self.weights, groups, cache=self._cache(),
                                             backend=self.backend, pow2_scales=self.pow2_scales,
                                             keep_transposed_weight=self.keep_transposed_weight,
                                             wgrad_deferral=self.wgrad_deferral)


class GroupedBF16Linear(_GroupedWeights):
    """The same layer in BF16 on `torch._grouped_mm` (unpadded; PyTorch's autograd). `groups` are sizes [G]."""

    def forward(self, x: torch.Tensor, groups) -> torch.Tensor:
        if type(groups) is Groups:
            groups = groups.tensor
        ends = torch.cumsum(groups, 0, dtype=torch.int32)
        w = self.weights[0] if self.weight_layout == "stacked" else stack_weights(self.weights)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)


# --------------------------------------------------------------------------------------------------------------
# The expert MLP
# --------------------------------------------------------------------------------------------------------------


class _GroupedMLP(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str,
                 linear: Callable[[int, int, int], nn.Module], backend: str = "auto"):
        super().__init__()
        check_int(num_experts, "num_experts", 1)
        check_int(hidden_size, "hidden_size", 1)
        check_int(ffn_hidden_size, "ffn_hidden_size", 1)
        _ext.check_backend(backend)
        self.backend = backend  # of the activation kernel (and, in GroupedFP8MLP, of the FP8 linears)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation = activation
        fc1_out = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        self.linear_fc1 = linear(num_experts, hidden_size, fc1_out)
        self.linear_fc2 = linear(num_experts, ffn_hidden_size, hidden_size)

    def _check_inputs(self, x, tokens_per_expert, probs, permutation=None) -> Groups:
        """The step's argument checks; returns the groups checked once for every GEMM and quantizer of the step."""
        check_tensor(x, "hidden_states", (torch.bfloat16,), dim=2)
        if x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [T, {self.hidden_size}], got {list(x.shape)}")
        rows = x.shape[0] if permutation is None else check_permutation(permutation, None, x).rows.shape[0]
        if not isinstance(tokens_per_expert, torch.Tensor):
            raise TypeError(
                "tokens_per_expert must be a device int tensor [num_experts] (read on the device only), "
                f"got {type(tokens_per_expert).__name__}"
            )
        if tokens_per_expert.dim() == 1 and tokens_per_expert.numel() != self.num_experts:
            raise ValueError(
                f"tokens_per_expert must hold num_experts={self.num_experts} sizes, got {tokens_per_expert.numel()}"
            )
        groups = check_groups(tokens_per_expert, self.num_experts, m_total=rows, device=x.device,
                              name="tokens_per_expert")
        if probs is not None:
            check_tensor(probs, "permuted_probs", (torch.float32, torch.bfloat16), dim=1)
            if probs.shape[0] != rows:
                raise ValueError(f"permuted_probs must be [T] = [{rows}], got {list(probs.shape)}")
            check_same_device(hidden_states=x, permuted_probs=probs)
        return groups

    def _mlp(self, x, groups, probs, permutation=None):
        """The expert rows' output, or with `permutation` the tokens' (x then the tokens; module docstring)."""
        if permutation is not None:
            x = gather_rows(x, permutation, backend=self.backend)
        h = self.linear_fc1(x, groups)
        y = self.linear_fc2(activation_times_probs(h, probs, self.activation, self.backend), groups)
        return y if permutation is None else combine_rows(y, permutation, backend=self.backend)

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: Optional[torch.Tensor] = None, permutation: Optional[Permutation] = None):
        """hidden_states bf16 [T, H] (rows grouped by expert), tokens_per_expert int32/int64 [G] on their device,
        permuted_probs FP32/BF16 [T] or None. Returns (bf16 [T, H], None).
        With `permutation` (megatron_tma.permutation): hidden_states are the routed tokens [T, H] in their own
        order, the experts' rows are `hidden_states[permutation.rows]` (tokens_per_expert and permuted_probs
        describe those rows), and the output is the tokens [T, H], each the FP32 sum of its experts' rows."""
        groups = self._check_inputs(hidden_states, tokens_per_expert, permuted_probs, permutation)
        return self._mlp(hidden_states, groups, permuted_probs, permutation), None

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}")


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling the module would run any hook (its own or the global ones): what nn.Module's call checks."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks or _module_hooks._global_forward_pre_hooks
                or _module_hooks._global_forward_hooks or _module_hooks._global_backward_pre_hooks
                or _module_hooks._global_backward_hooks)


class GroupedFP8MLP(_GroupedMLP):
    """The expert MLP on the FP8 grouped linears, unpadded (`pad_to=None`) or as the padded twin (16 or 128)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 pad_to: Optional[int] = None, backend: str = "auto", pow2_scales: bool = False, *,
                 weight_layout: str = "stacked", device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, recompute_activation: bool = False,
                 keep_transposed_weight: bool = True, defer_wgrad: bool = False,
                 step_refreshed_weights: bool = False, release_bf16_weights: bool = False):
        if pad_to not in PAD_TO:
            raise ValueError(f"pad_to must be None, 16 or 128, got {pad_to!r}")
        check_num_experts(num_experts)  # the weight-gradient GEMM's limit (megatron_tma.limits), on every backend
        check_int(hidden_size, "hidden_size")
        check_int(ffn_hidden_size, "ffn_hidden_size")
        if hidden_size % 128 or ffn_hidden_size % 128 or hidden_size <= 0 or ffn_hidden_size <= 0:
            raise ValueError(
                "hidden_size and ffn_hidden_size must be positive multiples of 128 (every FP8 GEMM of the layer "
                f"contracts over one of them in 128-wide scaling blocks), got {hidden_size} and {ffn_hidden_size}"
            )
        linear = functools.partial(GroupedFP8Linear, backend=backend, pow2_scales=pow2_scales,
                                   weight_layout=weight_layout, device=device, init_method=init_method,
                                   keep_transposed_weight=keep_transposed_weight, defer_wgrad=defer_wgrad,
                                   step_refreshed_weights=step_refreshed_weights,
                                   release_bf16_weights=release_bf16_weights)
        super().__init__(num_experts, hidden_size, ffn_hidden_size, activation, linear, backend)
        if not isinstance(recompute_activation, bool):
            raise TypeError(f"recompute_activation must be a bool, got {type(recompute_activation).__name__}")
        self.pad_to, self.recompute_activation = pad_to, recompute_activation
        # True: the step is planned once and runs two autograd nodes (megatron_tma.mlp_function: the same kernels and
        # bits, the checks once, a lower backward peak); False calls the linears and the activation through their
        # public entries (A/B runs, tests)
        self.planned_step = True

    def _mlp(self, x, groups, probs, permutation=None):
        plan = self._step_plan(x, groups, permutation)
        if plan is not None:  # the same Functions, checked once (megatron_tma.mlp_function)
            return fp8_expert_mlp(x, probs, plan, self.linear_fc1.weights, self.linear_fc2.weights)
        h = self.linear_fc1(x, groups, permutation=permutation)  # the gather fused into its quantizer
        if not self.recompute_activation:
            # the combine fused into fc2 too: backward gathers the output gradient inside dY's quantizer
            return self.linear_fc2(activation_times_probs(h, probs, self.activation, self.backend), groups,
                                   combine=permutation)
        y = self.linear_fc2(h, groups, probs, self.activation)
        return y if permutation is None else combine_rows(y, permutation, backend=self.backend)

    def _step_plan(self, x, groups, permutation) -> Optional[MlpPlan]:
        """The step's plan for megatron_tma.mlp_function (the same Functions and bits), or None where the public
        entries run instead: with `planned_step=False`, recompute_activation (its own Function), under torch.compile
        (the composed Functions are what it traces), hooks on the linears (their module calls run them: Megatron's
        parameter all-gather waits in a forward pre-hook), or weights the linears' own checks must word an error for
        (not BF16, not on x's device)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if (not self.planned_step or self.recompute_activation or torch.compiler.is_compiling()
                or _has_hooks(fc1) or _has_hooks(fc2)):
            return None
        w1, w2 = fc1.weights, fc2.weights
        device, backend, pow2 = x.device, self.backend, fc1.pow2_scales
        if (w1[0].dtype != torch.bfloat16 or w2[0].dtype != torch.bfloat16 or w1[0].device != device
                or w2[0].device != device or misalignment16(x) or fc1.backend != backend or fc2.backend != backend
                or fc2.pow2_scales != pow2 or (backend == "cuda" and not _ext._kernels_on(device))):
            return None
        if type(groups) is not Groups:  # (the padded twin's padded sizes)
            groups = check_groups(groups, self.num_experts, m_total=x.shape[0])
        rows = token_rows = None
        if permutation is not None:  # (checked with the inputs, against x)
            rows, token_rows = permutation
        return MlpPlan(groups, quantized_weights(w1, fc1._cache(), pow2, backend, fc1.keep_transposed_weight),
                       quantized_weights(w2, fc2._cache(), fc2.pow2_scales, backend, fc2.keep_transposed_weight),
                       self.activation, backend != "reference", backend, pow2, rows, token_rows, fc1.wgrad_deferral,
                       fc2.wgrad_deferral)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", pad_to={self.pad_to}"
                + (", recompute_activation=True" if self.recompute_activation else ""))

    def flush_wgrad(self) -> int:
        """With `defer_wgrad=True`: both linears' pending weight gradients, each in one GEMM (`GroupedFP8Linear.
        flush_wgrad`); returns how many backwards they held."""
        return max(self.linear_fc1.flush_wgrad(), self.linear_fc2.flush_wgrad())

    def invalidate_weight_cache(self) -> None:
        """Re-quantize the weights in the next forward (after updates their version counters do not show)."""
        self.linear_fc1.weight_cache.invalidate()
        self.linear_fc2.weight_cache.invalidate()

    def forward(self, hidden_states, tokens_per_expert, permuted_probs=None, permutation=None):
        if self.pad_to is None:
            return super().forward(hidden_states, tokens_per_expert, permuted_probs, permutation)
        self._check_inputs(hidden_states, tokens_per_expert, permuted_probs, permutation)
        if permutation is not None:  # the twin gathers in BF16: it is the oracle, not the fast path
            hidden_states = gather_rows(hidden_states, permutation, backend=self.backend)
        dest, padded, rows = self._padding_plan(hidden_states, tokens_per_expert)
        x_pad = hidden_states.new_zeros(rows, self.hidden_size).index_copy(0, dest, hidden_states)
        probs_pad = None
        if permuted_probs is not None:
            probs_pad = permuted_probs.new_zeros(rows).index_copy(0, dest, permuted_probs)
        out = self._mlp(x_pad, padded, probs_pad).index_select(0, dest)
        if permutation is not None:
            out = combine_rows(out, permutation, backend=self.backend)
        return out, None

    def _padding_plan(self, x, sizes):
        """(padded row of every token, padded sizes [G], rows of the padded buffers), all without a host read
        on the kernel path."""
        num_tokens, g = x.shape[0], self.num_experts
        padded = padded_sizes(sizes, self.pad_to)
        shift = sizes_to_offsets(padded)[:-1] - sizes_to_offsets(sizes)[:-1]
        expert = torch.repeat_interleave(sizes, output_size=num_tokens)  # expert of every token; no host read
        dest = torch.arange(num_tokens, device=x.device) + shift[expert]
        if self.backend != "reference" and not ops.reference_runs_on(x.device):
            rows = padded_row_count_upper_bound(num_tokens, g, self.pad_to)
        else:  # the reference reads the sizes on the host and wants groups that cover every row
            rows = int(padded.sum())
        return dest, padded, rows


class GroupedBF16MLP(_GroupedMLP):
    """The same expert MLP with BF16 `torch._grouped_mm` GEMMs: the BF16 baseline, same parameter names. The
    activation is the same fused one as the FP8 module's (`backend` picks it), so that a comparison of the two
    measures the GEMMs."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", *,
                 backend: str = "auto", weight_layout: str = "stacked", device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None):
        linear = functools.partial(GroupedBF16Linear, weight_layout=weight_layout, device=device,
                                   init_method=init_method)
        super().__init__(num_experts, hidden_size, ffn_hidden_size, activation, linear, backend)
