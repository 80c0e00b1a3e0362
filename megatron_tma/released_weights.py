"""Expert weights held in FP8 only between a step's first forward and the next optimizer step.

Under a mixed-precision optimizer the FP32 master weights are the truth and the BF16 parameters are a copy that the
optimizer rewrites after every step; the FP8 layer reads that copy once per step, to quantize it (W and W^T,
128x128 blocks), and never again. So a layer built with `release_bf16_weights=True` frees the BF16 parameter's
memory right after that quantization (the storage is resized to 0 bytes; the parameter object, its shape, its
`main_grad` and its place in the optimizer stay) and holds the FP8 copies instead; the memory comes back right
before the optimizer writes the new BF16 weights, when the FP8 copies are dropped. Across the forward and backward
passes, where the peak of a training step lies, the layer holds 2 bytes per weight (W's and W^T's FP8 copies) where
it held 4 (the BF16 weights and both copies), as much as a BF16 layer holds; at the optimizer step it holds the BF16
weights only. The bits are today's: the same kernel quantizes the same BF16 values.

What may write the released weights back:
* Megatron's mixed-precision optimizer (`Float16OptimizerWithFloat16Params`, also inside a `ChainedOptimizer`):
  `attach_optimizer` makes its copy of the main params into the model restore the released storage first. Its
  distributed optimizer is refused: its parameters are views of one shared buffer, which no layer may free alone.
* `load_state_dict` of the layer (restores, then copies the checkpoint in).
* `restore_bf16_weights(param)` by hand, for an optimizer of one's own that rewrites every element.
A torch optimizer that holds the BF16 parameter itself (no FP32 master) would step on freed memory: its step raises
instead (a global pre-step hook), as does saving a state dict while the weights are released (save after the
optimizer step, as Megatron does). Eager training only: refused under CUDA-graph capture (the storage moves when it
comes back) and in code torch.compile traces. Steps that an optimizer skips (Megatron's on a non-finite gradient)
leave the weights released and the FP8 copies valid: the weights did not change.

This is not yet the FP8 primary weights of Transformer Engine: the optimizer still writes BF16 weights (2 bytes per
weight, read again by the first forward's quantizer) rather than W and W^T straight from the FP32 master, and the
first forward of each layer holds both forms for the length of its quantization.
"""
from typing import Iterable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ReleasedBF16Weights", "attach_optimizer", "is_released", "restore_bf16_weights"]

# parameter -> the ReleasedBF16Weights that released it (by identity, weak: a dropped layer leaves no entry)
_RELEASED = WeakIdKeyDictionary()


def is_released(param: torch.Tensor) -> bool:
    """Whether `param`'s memory is released (its values live in its layer's FP8 copies only)."""
    owner = _RELEASED.get(param)
    return owner is not None and owner.released


def restore_bf16_weights(params: Iterable[torch.Tensor]) -> int:
    """Give the released ones of `params` their memory back (uninitialised: the caller writes every element next) and
    drop their layers' FP8 copies; returns how many layers that was."""
    owners = {id(o): o for o in (_RELEASED.get(p) for p in params) if o is not None and o.released}
    for owner in owners.values():
        owner.restore()
    return len(owners)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ReleasedBF16Weights:
    """A layer's weight cache (`FP8WeightCache`'s `get`) that, after a training forward has quantized the weights,
    frees their BF16 memory and serves the FP8 copies it keeps until `restore()` (module docstring)."""

    def __init__(self, inner) -> None:
        self.inner = inner  # the FP8WeightCache that quantizes while the weights are there
        self._params = ()  # the released parameters (strong while released: their storage must come back)
        self._nbytes = 0
        self._value = None  # the FP8 copies served while released

    @property
    def released(self) -> bool:
        return self._value is not None

    def invalidate(self) -> None:
        """Megatron's first-micro-batch flag: while released, the held copies are the weights (nothing changed them
        without restoring them first); otherwise the inner cache re-quantizes."""
        if not self.released:
            self.inner.invalidate()

    def __deepcopy__(self, memo) -> "ReleasedBF16Weights":
        return type(self)(type(self.inner)())

    def __getstate__(self) -> dict:
        return {"inner": type(self.inner)()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["inner"])

    @torch.compiler.disable
    def get(self, weights, pow2: bool = False, backend: str = "auto", keep_transposed: bool = True):
        if _capturing():
            raise RuntimeError("release_bf16_weights: a layer that frees its BF16 weights cannot be captured in a CUDA "
                               "graph (their memory moves when it comes back); build it without release_bf16_weights")
        if self.released:
            if self._value.qt is None and keep_transposed:
                raise RuntimeError("release_bf16_weights: the copies held lack W^T (keep_transposed changed while "
                                   "the weights were released)")
            return self._value
        value = self.inner.get(weights, pow2, backend, keep_transposed)
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            self._release(tuple(weights), value)
        return value

    def _release(self, weights, value) -> None:
        storage = weights[0].untyped_storage()
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        if any(w.untyped_storage().data_ptr() != storage.data_ptr() for w in weights) or storage.nbytes() != nbytes:
            # e.g. the views of Megatron's distributed optimizer's parameter buffer: freeing it frees other weights
            raise RuntimeError(
                "release_bf16_weights: the layer's weights must be the only tensors in their storage (one storage "
                f"of {nbytes} bytes; this one has {storage.nbytes()}): parameters inside a shared buffer, such as "
                "Megatron's distributed optimizer's, cannot be released")
        for w in weights:
            _RELEASED[w] = self
        storage.resize_(0)
        self._params, self._nbytes, self._value = weights, nbytes, value

    def restore(self) -> None:
        """The BF16 memory back (uninitialised), the FP8 copies dropped: the next forward quantizes what is written."""
        if not self.released:
            return
        self._params[0].untyped_storage().resize_(self._nbytes)
        self._params, self._value = (), None
        self.inner.invalidate()


def _refuse_steps_on_released(optimizer, args, kwargs) -> None:
    """A torch optimizer whose parameters include released ones would read and write freed memory."""
    if not _RELEASED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_released(p):
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() on expert weights whose BF16 memory is released "
                    "(release_bf16_weights=True keeps them in FP8 between the first forward and the optimizer "
                    "step): use an optimizer with FP32 master weights that rewrites them (Megatron's mixed-precision "
                    "optimizer, megatron_tma.released_weights.attach_optimizer), or build the layer without it")


_pre_step_hook = register_optimizer_step_pre_hook(_refuse_steps_on_released)


def _mixed_precision_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for o in chained:
            yield from _mixed_precision_optimizers(o)
    else:
        yield optimizer


def attach_optimizer(optimizer) -> int:
    """Make Megatron's mixed-precision optimizer (or each one in a `ChainedOptimizer`) restore the released weights
    of its model right before it copies its FP32 main params into them. Returns how many optimizers it attached to.
    Refuses Megatron's distributed optimizer and anything without that copy."""
    count = 0
    for opt in _mixed_precision_optimizers(optimizer):
        name = type(opt).__name__
        if name == "DistributedOptimizer" or not hasattr(opt, "float16_groups"):
            raise TypeError(
                f"release_bf16_weights: {name} is not Megatron's Float16OptimizerWithFloat16Params, whose copy of "
                "the FP32 main params rewrites every BF16 weight (the distributed optimizer's parameters share "
                "one buffer, which cannot be released per layer): use --use-distributed-optimizer off or build the "
                "experts without release_bf16_weights")
        if getattr(opt, "_megatron_tma_restores_released", False):
            count += 1
            continue
        copy_to_model, copy_from_model = opt._copy_main_params_to_model_params, opt._copy_model_params_to_main_params

        def restore_then_copy(*args, opt=opt, copy=copy_to_model, **kwargs):
            restore_bf16_weights([p for group in opt.float16_groups for p in group])
            return copy(*args, **kwargs)

        def refuse_released_reads(*args, opt=opt, copy=copy_from_model, **kwargs):
            if any(is_released(p) for group in opt.float16_groups for p in group):
                raise RuntimeError("release_bf16_weights: the FP32 main params cannot be reloaded from expert "
                                   "weights whose BF16 memory is released (load a checkpoint into the model first)")
            return copy(*args, **kwargs)

        opt._copy_main_params_to_model_params = restore_then_copy
        opt._copy_model_params_to_main_params = refuse_released_reads
        opt._megatron_tma_restores_released = True
        count += 1
    return count


def released_bytes(module: torch.nn.Module) -> int:
    """How many bytes of `module`'s parameters are released now (0 when none)."""
    return sum(o._nbytes for o in {id(o): o for o in (_RELEASED.get(p) for p in module.parameters())
                                   if o is not None and o.released}.values())


def held_copies(cache) -> Optional[tuple]:
    """The FP8 copies a layer's cache holds (its `_value`), whichever cache it is."""
    if isinstance(cache, ReleasedBF16Weights):
        return cache._value if cache.released else cache.inner._value
    return getattr(cache, "_value", None)
