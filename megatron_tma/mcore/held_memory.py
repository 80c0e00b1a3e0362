"""What each byte a Megatron training run holds between steps is: `held_bytes(models, optimizer)` sorts the bytes of
the model chunks' parameters, their gradients (`main_grad`, `.grad`), the FP8 weight copies megatron_tma's experts
keep, and the optimizer's FP32 masters and state (Adam's moments) into expert and other parts.

Why: a model's peak memory is mostly this state (with Megatron's mixed-precision Adam ~18 bytes a parameter), so
comparing the peaks of two expert paths means little until one knows which bytes differ (issue "FP8 experts that
use less memory than BF16 experts": "show what each byte is"). The recipe records it per mode next to the peak.

Each byte counts once (views of one storage that overlap count their union: Megatron's DDP lays every `main_grad`
into one buffer, and its distributed optimizer's shard gradients are views of those), under the first part that
names it in the order above; a released BF16 weight (no memory, megatron_tma.released_weights) counts 0. A parameter
is an expert's when its name has an `experts` module in it (Megatron's `...mlp.experts.linear_fc1.weight0`). An
optimizer master is attributed through its model parameter where the optimizer pairs them (Megatron's
`Float16OptimizerWithFloat16Params`: `float16_groups` / `fp32_from_float16_groups`; its `DistributedOptimizer`:
`model_float16_groups` / `shard_fp32_from_float16_groups` and `model_fp32_groups` / `shard_fp32_groups`; an FP32
model parameter stepped as is is its own master); otherwise its bytes go to the `unpaired_` parts. Transformer
Engine's own FP8 weight copies are not found (its modules keep them privately): a caller that compares the total with
the allocator's count sees them in the difference.
"""
from typing import Dict, Iterable

import torch

from ..released_weights import held_copies

__all__ = ["PARTS", "held_bytes"]

PARTS = ("expert_weights", "expert_fp8_copies", "expert_grads", "expert_masters", "expert_optimizer_state",
         "other_weights", "other_grads", "other_masters", "other_optimizer_state",
         "unpaired_masters", "unpaired_grads", "unpaired_optimizer_state")

# (model parameters, their masters) group lists of Megatron's optimizers: Float16OptimizerWithFloat16Params, then
# DistributedOptimizer's float16 and fp32 parameters with their shards
_PAIRINGS = (("float16_groups", "fp32_from_float16_groups"), ("model_float16_groups", "shard_fp32_from_float16_groups"),
             ("model_fp32_groups", "shard_fp32_groups"))


def _is_expert(name: str) -> bool:
    return "experts" in name.split(".")


def _sub_optimizers(optimizer):
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):  # Megatron's ChainedOptimizer (a rank may hold none)
        return list(optimizer.chained_optimizers)
    return [optimizer]


class _Counter:
    """Bytes of tensors, each byte of a storage once: per storage the byte intervals already counted."""

    def __init__(self):
        self.spans = {}  # storage pointer -> sorted disjoint [start, end) byte intervals

    def new_bytes(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        if t.device.type == "meta" or storage.nbytes() == 0 or t.numel() == 0:
            return 0
        # the bytes the tensor spans in its storage (a contiguous tensor's own bytes; a strided view's whole extent)
        offset, size = t.data_ptr() - storage.data_ptr(), t.element_size()
        start = offset + size * sum(st * (n - 1) for st, n in zip(t.stride(), t.shape) if st < 0)
        end = offset + size * (1 + sum(st * (n - 1) for st, n in zip(t.stride(), t.shape) if st > 0))
        spans = self.spans.setdefault(storage.data_ptr(), [])
        length, covered, merged = end - start, 0, []
        for a, b in spans:
            if b < start or a > end:
                merged.append((a, b))
            else:  # overlapping or touching: its overlap is counted already, the union replaces both
                covered += max(0, min(b, end) - max(a, start))
                start, end = min(a, start), max(b, end)
        merged.append((start, end))
        self.spans[storage.data_ptr()] = sorted(merged)
        return length - covered


def held_bytes(models: Iterable[torch.nn.Module], optimizer=None) -> Dict[str, int]:
    """{part: bytes} over PARTS (module docstring), every part present (0 where none)."""
    out = {part: 0 for part in PARTS}
    counter = _Counter()

    def add(part, t):
        if isinstance(t, torch.Tensor):
            out[part] += counter.new_bytes(t)

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
        for params_attr, masters_attr in _PAIRINGS:
            for group, masters in zip(getattr(opt, params_attr, None) or (), getattr(opt, masters_attr, None) or ()):
                for p, m in zip(group, masters):
                    master_kind[id(m)] = kind.get(id(p), "unpaired")
        inner = getattr(opt, "optimizer", opt)
        for group in getattr(inner, "param_groups", ()):
            for m in group["params"]:
                k = master_kind.get(id(m), kind.get(id(m), "unpaired"))  # (an FP32 model parameter: its own master)
                add(f"{k}_masters", m)
                add(f"{k}_grads", m.grad)
                for t in getattr(inner, "state", {}).get(m, {}).values():
                    add(f"{k}_optimizer_state", t)
    return out
