"""Expert weights held in FP8 only: the BF16 copy of the weights freed once quantized, the FP8 copies written from the
optimizer's FP32 masters.

Under a mixed-precision optimizer the FP32 master weights are the truth and the BF16 parameters a copy that the
optimizer rewrites after every step; the FP8 layer reads that copy once per step, to quantize it (W and W^T, 128x128
blocks), and never again. So a layer built with `release_bf16_weights=True` frees the BF16 parameter's memory right
after its first training forward has quantized it (the storage resized to 0 bytes; the parameter object, its shape,
its `main_grad` and its place in the optimizer stay) and holds the FP8 copies instead. From then on each optimizer step
writes the FP8 copies straight from the FP32 master (`quantize_128x128_from_master`: one read of the master, the bytes
of quantizing its BF16 rounding, i.e. today's bits) instead of writing BF16 weights that the next forward would read
to quantize: the layer holds 2 bytes per weight (W's and W^T's copies) where it held 4 (the BF16 weights and both
copies), at the optimizer step too. A layer whose weights are G parameters (`weight_layout="per_expert"`: G masters
would have to be stacked first) gets its BF16 memory back before the step's copy and quantizes at its next forward.

Who writes the weights:
* Megatron's mixed-precision optimizer (`Float16OptimizerWithFloat16Params`, also inside a `ChainedOptimizer`):
  `attach_optimizer` makes its copy of the main params into the model write the released layers' FP8 copies from
  their masters (its own copy runs on the other parameters). Its distributed optimizer is refused: its parameters
  are views of one shared buffer, which no layer may free alone, and its masters are shards.
* `write_weights_from_masters(params, masters)`, for an optimizer of one's own with FP32 masters.
* `load_state_dict` of the layer (its memory back, the checkpoint copied in; the next forward quantizes and releases).
Checkpoints read BF16 weights: a state dict holds the masters' BF16 rounding (`bf16_weights`: fresh tensors, the plain
layer's bits; the layer stays released), and the Megatron experts' `sharded_state_dict`, whose entries are the
parameters themselves, writes them back from the masters (`materialize_bf16_weights`); the next forward releases them
again. Only layers whose weights all train are released (an optimizer writes back only the weights it holds). Refused with a clear error: a torch optimizer stepping on the released parameters themselves (no master: a
global pre-step hook), a state dict while released before any master wrote the copies, the main params' reload from
released weights; CUDA-graph capture (the memory moves) and code torch.compile traces. A step that an optimizer skips
(Megatron's on a non-finite gradient) writes nothing: the copies stay valid.

Not yet Transformer Engine's FP8 primary weights in full: the distributed optimizer (FP8 parameter all-gather from
sharded masters) is not supported, and the layer's first forward after building or loading holds the BF16 weights and
their copies together while it quantizes.
"""
import weakref
from typing import Iterable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ReleasedBF16Weights", "attach_optimizer", "is_released", "materialize_bf16_weights",
           "restore_bf16_weights", "write_weights_from_masters"]

# parameter -> the ReleasedBF16Weights that released it (by identity, weak: an entry lives as long as its parameter, so
# a parameter still held elsewhere -- an optimizer's groups -- stays known as released after its layer is dropped, and
# the owner holds its parameters weakly in turn, so that the entry never keeps its own key alive)
_RELEASED = WeakIdKeyDictionary()
# parameters of the Megatron optimizers attach_optimizer wrapped (weak, by identity): what their step writes back
_ATTACHED = WeakIdKeyDictionary()


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
        # the released parameters, weakly (module docstring of the registry above): their storage comes back on restore
        # while they live; a parameter that is gone has nothing to give back
        self._param_refs = ()
        self._nbytes = 0
        self._value = None  # the FP8 copies served while released
        self._settings = None  # (pow2, backend, keep_transposed) of the layer's forward: how to quantize its masters
        self._master = None  # the FP32 master the copies were last written from (write_from_master)

    @property
    def _params(self) -> tuple:
        """The released parameters while all of them live, else ()."""
        params = tuple(r() for r in self._param_refs)
        return params if all(p is not None for p in params) else ()

    @property
    def released(self) -> bool:
        return bool(self._params)

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
            if len(weights) != len(self._params) or any(w is not p for w, p in zip(weights, self._params)):
                raise RuntimeError("release_bf16_weights: the layer's weights were replaced while released (their "
                                   "FP8 copies are of the old ones); load new weights with load_state_dict")
            if self._value.qt is None and keep_transposed:
                raise RuntimeError("release_bf16_weights: the copies held lack W^T (keep_transposed changed while "
                                   "the weights were released)")
            return self._value
        value = self.inner.get(weights, pow2, backend, keep_transposed)
        self._settings = (pow2, backend, keep_transposed)
        # Only weights that all train are released: an optimizer writes back the ones it holds, and Megatron's leaves
        # out those with requires_grad=False (their memory would come back uninitialised with the others')
        if torch.is_grad_enabled() and all(w.requires_grad for w in weights):
            self._release(tuple(weights), value)
        return value

    def feeds_from(self, param: torch.Tensor, master: torch.Tensor) -> bool:
        """Whether `write_from_master(master)` can stand for the copy of `master` into `param`: the layer has run a
        forward (its quantization settings are known) and holds its weights in one `[G, N, K]` parameter (`param`,
        released) of the master's shape."""
        return (self.released and self._settings is not None and len(self._params) == 1
                and self._params[0] is param and master.shape == param.shape and master.dtype == torch.float32)

    def write_from_master(self, master: torch.Tensor) -> None:
        """The FP8 copies (W, and W^T unless the layer makes it in backward) written from the FP32 master in one pass,
        as the quantizer would write them from the BF16 copy an optimizer makes of it (`quantize_128x128_from_master`:
        the same bytes); the BF16 weights stay released. The old copies go first: one set alive at a time."""
        from . import quant
        from .autograd import QuantizedWeights

        pow2, backend, keep_transposed = self._settings
        self._value = self._master = None
        self.inner.invalidate()
        try:
            with torch.no_grad():
                q, s, qt, st = quant.quantize_128x128_from_master(master.detach(), pow2, backend=backend)
        except BaseException:
            # (out of memory at the step's peak, say) the weights back in BF16, as the optimizer's copy makes them,
            # so that the layer stays usable and consistent with the others
            param = self._params[0]
            self.restore()
            with torch.no_grad():
                param.copy_(master)
            raise
        self._value = QuantizedWeights(q, s, qt, st) if keep_transposed else QuantizedWeights(q, s, None, None)
        self._master = master

    def _known_master(self):
        """The FP32 master of the released weights: the one the copies were written from, or, before any write (every
        step so far skipped), the one Megatron's mixed-precision optimizer hangs on the parameter (`main_param`), which
        the BF16 weights were last copied from; None when there is neither (a layer of G parameters has none)."""
        if self._master is not None:
            return self._master
        if len(self._params) == 1:
            master = getattr(self._params[0], "main_param", None)
            if isinstance(master, torch.Tensor) and master.shape == self._params[0].shape:
                return master
        return None

    def bf16_weights(self):
        """The BF16 weights as the optimizer's copy would have made them, while released (fresh tensors from the
        master: the layer stays released), or None when no master is known."""
        master = self._known_master()
        return None if master is None else master.detach().to(torch.bfloat16)

    def materialize(self) -> bool:
        """Write the BF16 weights back from the master the copies were written from (its BF16 rounding, as the
        optimizer's copy would have made them), for a checkpoint; the next forward quantizes them (the same bits) and
        releases them again. False when released with no master to write from (nothing done)."""
        if not self.released:
            return True
        master, param = self._known_master(), self._params[0]
        if master is None:
            return False
        self.restore()
        with torch.no_grad():
            param.copy_(master)
        return True

    def _release(self, weights, value) -> None:
        storage = weights[0].untyped_storage()
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        if any(w.untyped_storage().data_ptr() != storage.data_ptr() for w in weights):
            raise RuntimeError(
                "release_bf16_weights: the layer's weights lie in separate storages (moved one by one with .to(), or "
                "assigned from a checkpoint's tensors); the layer frees one storage of its own: build it on its device")
        if storage.nbytes() != nbytes:
            # e.g. the views of Megatron's distributed optimizer's parameter buffer: freeing it frees other weights
            raise RuntimeError(
                "release_bf16_weights: the layer's weights must be the only tensors in their storage (one storage "
                f"of {nbytes} bytes; this one has {storage.nbytes()}): parameters inside a shared buffer, such as "
                "Megatron's distributed optimizer's, cannot be released")
        if any(hasattr(w, "main_param") and w not in _ATTACHED for w in weights):
            # Megatron's mixed-precision optimizer holds these weights (it hangs their master on them) but would copy
            # its masters into memory that is gone: its copy must be the attached one
            raise RuntimeError("release_bf16_weights: Megatron's optimizer over these expert weights is not attached; "
                               "call megatron_tma.released_weights.attach_optimizer(optimizer) after building it")
        for w in weights:
            _RELEASED[w] = self
        storage.resize_(0)
        self._param_refs, self._nbytes, self._value = tuple(weakref.ref(w) for w in weights), nbytes, value

    def restore(self) -> None:
        """The BF16 memory back (uninitialised), the FP8 copies dropped: the next forward quantizes what is written."""
        if not self.released:
            return
        self._params[0].untyped_storage().resize_(self._nbytes)
        self._param_refs, self._value, self._master = (), None, None
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


def write_weights_from_masters(params, masters) -> list:
    """An optimizer step's write of its FP32 `masters` into the BF16 `params`, for the layers that released theirs:
    their FP8 copies straight from the masters (`ReleasedBF16Weights.write_from_master`: no BF16 weights made), the
    other released ones' memory given back (uninitialised). Returns [(param, master)], the pairs the caller still
    copies (every pair not written here)."""
    rest = []
    for param, master in zip(params, masters):
        owner = _RELEASED.get(param)
        if owner is not None and owner.feeds_from(param, master):
            owner.write_from_master(master)
        else:
            rest.append((param, master))
    restore_bf16_weights([p for p, _ in rest])
    return rest


def _copy_main_params(opt, copy, *args, **kwargs):
    """Megatron's copy of the main params into the model, the pairs that `write_weights_from_masters` wrote taken out
    of its groups for the length of the call (its own copy runs on the others)."""
    groups, mains = opt.float16_groups, opt.fp32_from_float16_groups
    pairs = [(p, m) for group, main_group in zip(groups, mains) for p, m in zip(group, main_group)]
    rest = {id(p) for p, _ in write_weights_from_masters([p for p, _ in pairs], [m for _, m in pairs])}
    if len(rest) == len(pairs):
        return copy(*args, **kwargs)
    opt.float16_groups = [[p for p in group if id(p) in rest] for group in groups]
    opt.fp32_from_float16_groups = [[m for p, m in zip(group, main_group) if id(p) in rest]
                                    for group, main_group in zip(groups, mains)]
    try:
        return copy(*args, **kwargs)
    finally:
        opt.float16_groups, opt.fp32_from_float16_groups = groups, mains


def materialize_bf16_weights(params) -> None:
    """Write released `params` back in BF16 from the masters their FP8 copies came from (checkpoints read them);
    a RuntimeError for released ones with none (their values live in FP8 only)."""
    for owner in {id(o): o for o in (_RELEASED.get(p) for p in params) if o is not None}.values():
        if not owner.materialize():
            raise RuntimeError("release_bf16_weights: the BF16 expert weights are released (held in FP8 from the "
                               "first training forward to the optimizer step) and no FP32 master wrote their copies; "
                               "save the state dict after the optimizer step, as Megatron does")


def _mixed_precision_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for o in chained:
            yield from _mixed_precision_optimizers(o)
    else:
        yield optimizer


def attach_optimizer(optimizer) -> int:
    """Make Megatron's mixed-precision optimizer (or each one in a `ChainedOptimizer`) write the released layers'
    FP8 copies from its FP32 main params where it would copy them into the BF16 weights (`write_weights_from_masters`;
    its own copy runs on the other parameters), and refuse to reload its main params from released weights. Returns
    how many optimizers it attached to. Refuses Megatron's distributed optimizer and anything without that copy."""
    count = 0
    if type(optimizer).__name__ == "LayerWiseDistributedOptimizer":  # (its all-gather copies into every rank's weights)
        raise TypeError("release_bf16_weights: Megatron's LayerWiseDistributedOptimizer copies other ranks' updated "
                        "weights into the BF16 parameters, which released layers no longer hold; use the plain "
                        "optimizer or build the experts without release_bf16_weights")
    for opt in _mixed_precision_optimizers(optimizer):
        name = type(opt).__name__
        if getattr(opt, "is_stub_optimizer", False):  # (Megatron's empty stand-in for a rank with no parameters)
            continue
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
            return _copy_main_params(opt, copy, *args, **kwargs)

        def refuse_released_reads(*args, opt=opt, copy=copy_from_model, **kwargs):
            if any(is_released(p) for group in opt.float16_groups for p in group):
                raise RuntimeError("release_bf16_weights: the FP32 main params cannot be reloaded from expert "
                                   "weights whose BF16 memory is released (load a checkpoint into the model first)")
            return copy(*args, **kwargs)

        opt._copy_main_params_to_model_params = restore_then_copy
        opt._copy_model_params_to_main_params = refuse_released_reads
        opt._megatron_tma_restores_released = True
        for group in opt.float16_groups:
            for p in group:
                _ATTACHED[p] = True
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
