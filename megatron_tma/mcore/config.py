"""What a Megatron `TransformerConfig` asks of the experts, in the terms of `megatron_tma.mlp` (no Megatron import).

`expert_mlp_args(config)` reads the fields that decide the expert MLP and refuses, with the field's name, every
setting the FP8 experts do not implement, instead of training something else silently. It only reads attributes,
so any object with Megatron's field names can be checked (the CPU tests do that without Megatron installed).
"""
import re
from typing import NamedTuple, Optional

import torch

__all__ = ["CONFIG_FLAG", "TRANSPOSE_FLAG", "REFRESH_FLAG", "RELEASE_FLAG", "MODES", "ExpertMLPArgs", "expert_mlp_args", "pad_to_of", "from_sequential_mlp_key"]

# The experts a Megatron layer spec can be given (megatron_tma.mcore.spec): the unpadded FP8 MLP, its padded twin
# (every expert's tokens padded to 16 or 128 rows, the same FP8 Functions: the bit-exactness oracle), and the same
# MLP with BF16 GEMMs.
MODES = ("unpadded", "padded16", "padded128", "bf16")
# The config flag: a TransformerConfig attribute, None (Megatron's own experts) or one of MODES
# (megatron_tma.mcore.spec.layer_spec_from_config reads it).
CONFIG_FLAG = "moe_megatron_tma_experts"
# A TransformerConfig attribute, bool (unset: False): the FP8 experts keep W's FP8 copy only and make W^T's in each
# backward (megatron_tma.mlp's keep_transposed_weight=False: the same bits, one layer's W^T alive at a time).
TRANSPOSE_FLAG = "moe_megatron_tma_transpose_weights_in_backward"
# A TransformerConfig attribute, bool (unset: False): the FP8 experts keep their weight copies in fixed buffers that a
# kernel refreshes on the device after each optimizer step (megatron_tma.mlp's step_refreshed_weights=True): what
# lets a CUDA graph of the MoE layer replay micro-batches 2..N of a step without the weight pass.
REFRESH_FLAG = "moe_megatron_tma_step_refreshed_weights"
# A TransformerConfig attribute, bool (unset: False): the FP8 experts free their BF16 weights' memory after the first
# training forward and hold FP8 copies only, which Megatron's optimizer writes from its FP32 main params at each step
# (megatron_tma.mlp's release_bf16_weights=True; attach it with megatron_tma.released_weights.attach_optimizer).
RELEASE_FLAG = "moe_megatron_tma_release_bf16_weights"


class ExpertMLPArgs(NamedTuple):
    hidden_size: int
    ffn_hidden_size: int  # this rank's share: moe_ffn_hidden_size / expert_tensor_parallel_size
    activation: str  # one of megatron_tma.mlp.ACTIVATIONS


_SEQUENTIAL_WEIGHT = re.compile(r"^(|.*\.)local_experts\.(\d+)\.linear_fc([12])\.weight$")


def from_sequential_mlp_key(key: str) -> Optional[str]:
    """The state-dict key these experts give the weight that Megatron's `SequentialMLP` keys
    `[...]local_experts.{i}.linear_fc{j}.weight` (`[...]linear_fc{j}.weight{i}`, Transformer Engine's), or None for
    any other key (the linears' `_extra_state`, every non-expert weight)."""
    m = _SEQUENTIAL_WEIGHT.match(key)
    return f"{m.group(1)}linear_fc{m.group(3)}.weight{m.group(2)}" if m else None


def pad_to_of(mode: str) -> Optional[int]:
    """The padded twin's row alignment of a mode (None: unpadded, or not an FP8 mode)."""
    if mode not in MODES:
        raise ValueError(f"experts mode must be one of {', '.join(MODES)}, got {mode!r}")
    return {"padded16": 16, "padded128": 128}.get(mode)


def _activation_of(config) -> str:
    func = getattr(config, "activation_func", None)
    name = getattr(func, "__name__", repr(func))
    gated = bool(getattr(config, "gated_linear_unit", False))
    if gated and func is torch.nn.functional.silu:
        return "swiglu"
    if gated and func is torch.nn.functional.gelu:
        return "geglu"
    if not gated and func is torch.nn.functional.gelu:
        return "gelu"
    if not gated and name == "squared_relu":  # megatron.core.activations.squared_relu
        return "squared_relu"
    raise ValueError(
        "the FP8 experts implement SwiGLU (gated_linear_unit=True, activation_func=F.silu), GeGLU "
        "(gated_linear_unit=True, activation_func=F.gelu), GELU "
        "(gated_linear_unit=False, activation_func=F.gelu) and squared ReLU (gated_linear_unit=False, "
        f"activation_func=squared_relu); the config has gated_linear_unit={gated}, activation_func={name}"
    )


def expert_tensor_parallel_size(config) -> int:
    """The ranks each expert's FFN is split over: `expert_tensor_parallel_size`, which Megatron's config resolves
    to `tensor_model_parallel_size` when it is left None."""
    return int(getattr(config, "expert_tensor_parallel_size", None)
               or getattr(config, "tensor_model_parallel_size", None) or 1)


def expert_mlp_args(config) -> ExpertMLPArgs:
    """The expert MLP a Megatron MoE config describes, or a ValueError naming the unsupported field."""

    def refuse(field: str, why: str):
        raise ValueError(f"config.{field}={getattr(config, field)!r}: {why}")

    if not getattr(config, "num_moe_experts", None):
        refuse("num_moe_experts", "not a mixture-of-experts config")
    if getattr(config, "add_bias_linear", False):
        refuse("add_bias_linear", "the FP8 experts have no biases (set add_bias_linear=False)")
    if getattr(config, "moe_latent_size", None) is not None:
        refuse("moe_latent_size", "latent expert projections are not implemented")
    if getattr(config, "moe_apply_probs_on_input", False) and getattr(config, "moe_router_topk", 1) != 1:
        refuse("moe_router_topk", "moe_apply_probs_on_input=True needs moe_router_topk=1, as Megatron's experts do")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        refuse("activation_func_clamp_value", "clamped GLU inputs are not implemented")
    if getattr(config, "glu_linear_offset", 0.0):
        refuse("glu_linear_offset", "a GLU linear offset is not implemented")
    if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
        refuse("moe_mlp_glu_interleave_size", "the gate half comes first (Megatron's default layout)")
    for field in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        if getattr(config, field, False):  # both make Megatron call experts.backward_dw() for a deferred wgrad
            refuse(field, "the FP8 experts compute their weight gradients in the backward itself (no deferred "
                   "backward_dw); turn it off")
    if getattr(config, "params_dtype", torch.bfloat16) != torch.bfloat16:
        refuse("params_dtype", "the expert weights are BF16 (the FP8 copies are made from them)")
    hidden = int(config.hidden_size)
    ffn = getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size
    for field, value in (("hidden_size", hidden), ("moe_ffn_hidden_size", ffn)):
        if value <= 0 or value % 128:
            raise ValueError(
                f"config.{field}={value}: must be a positive multiple of 128 (every FP8 GEMM of the experts "
                "contracts over the hidden or the expert FFN size in 128-wide scaling blocks)"
            )
    if (getattr(config, "expert_gtp_weight_remat_size", 1) or 1) > 1:
        refuse("expert_gtp_weight_remat_size", "expert weights sharded beyond expert tensor parallelism (expert GTP, "
               "expert_tensor_parallel_num_weight_shards) are not implemented")
    etp = expert_tensor_parallel_size(config)
    if ffn % (128 * etp):
        raise ValueError(
            f"config.moe_ffn_hidden_size={ffn} over expert_tensor_parallel_size={etp} ranks (config."
            "expert_tensor_parallel_size, or tensor_model_parallel_size where that is None): each rank holds "
            f"{ffn / etp:g} of the FFN columns, which must be a multiple of 128 (the FP8 scaling blocks)"
        )
    return ExpertMLPArgs(hidden, int(ffn) // etp, _activation_of(config))
