"""What each byte a Megatron training run holds between steps is: `held_bytes(models, optimizer)` sorts the bytes of
the model chunks' parameters, their gradients (`main_grad`, `.grad`), the FP8 weight copies megatron_tma's experts
keep, and the optimizer's FP32 masters and state (Adam's moments) into expert and other parts.

Why: a model's peak memory is mostly this state (with Megatron's mixed-precision Adam ~18 bytes a parameter), so
comparing the peaks of two expert paths means little until one knows which bytes differ (issue "FP8 experts that
use less memory than BF16 experts": "show what each byte is"). The recipe records it per mode next to the peak.

Each tensor counts once, by its own bytes (a view into a larger buffer counts its view: Megatron's DDP lays every
`main_grad` into one buffer), under the first part that names it in the order above; a released BF16 weight (no
memory, megatron_tma.released_weights) counts 0. A parameter is an expert's when its name has an `experts` module
in it (Megatron's `...mlp.experts.linear_fc1.weight0`). An optimizer master is attributed through its model
parameter where the optimizer pairs them (Megatron's `Float16OptimizerWithFloat16Params`: `float16_groups` /
`fp32_from_float16_groups`; an FP32 model parameter is its own master); otherwise its bytes go to the `_unpaired`
parts. Transformer Engine's own FP8 weight copies are not found (its modules keep them privately): a caller that
compares the total with the allocator's count sees them in the difference.
"""
from typing import Dict, Iterable

import torch

from ..released_weights import held_copies

__all__ = ["PARTS", "held_bytes"]

PARTS = ("expert_weights", "expert_fp8_copies", "expert_grads", "expert_masters", "expert_optimizer_state",
         "other_weights", "other_grads", "other_masters", "other_optimizer_state",
         "unpaired_masters", "unpaired_optimizer_state")


def _is_expert(name: str) -> bool:
    return "experts" in name.split(".")


def _sub_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else []))


def held_bytes(models: Iterable[torch.nn.Module], optimizer=None) -> Dict[str, int]:
    """{part: bytes} over PARTS (module docstring), every part present (0 where none)."""
    out = {part: 0 for part in PARTS}
    seen = set()

    def add(part, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return
        key = (t.data_ptr(), t.numel() * t.element_size(), t.dtype)
        if key not in seen:
            seen.add(key)
            out[part] += t.numel() * t.element_size()

    kind = {}  # id(model parameter) -> "expert" / "other"
    for model in models:
        for name, p in model.named_parameters():
            k = "expert" if _is_expert(name) else "other"
            kind[id(p)] = k
            add(f"{k}_weights", p)
            add(f"{k}_grads", getattr(p, "main_grad", None))
            add(f"{k}_grads", p.grad)
        for name, module in model.named_modules():
            cache = getattr(module, "weight_cache", None)
            if cache is not None:
                for t in held_copies(cache) or ():
                    add("expert_fp8_copies" if _is_expert(name) else "other_weights", t)
    for opt in _sub_optimizers(optimizer):
        master_kind = {}  # id(master) -> kind of its model parameter
        for group, masters in zip(getattr(opt, "float16_groups", ()), getattr(opt, "fp32_from_float16_groups", ())):
            for p, m in zip(group, masters):
                master_kind[id(m)] = kind.get(id(p), "unpaired")
        inner = getattr(opt, "optimizer", opt)
        for group in getattr(inner, "param_groups", ()):
            for m in group["params"]:
                k = master_kind.get(id(m), kind.get(id(m), "unpaired"))  # (an FP32 model parameter: its own master)
                add("unpaired_masters" if k == "unpaired" else f"{k}_masters", m)
                add("unpaired_masters" if k == "unpaired" else f"{k}_grads", m.grad)
                for t in getattr(inner, "state", {}).get(m, {}).values():
                    add(f"{k}_optimizer_state", t)
    return out
