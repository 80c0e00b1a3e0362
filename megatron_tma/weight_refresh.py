"""FP8 weight copies refreshed on the device once per optimizer step: what a CUDA graph replays without the weight pass.

`FP8WeightCache` decides on the host (pointers, version counters, the optimizer-step stamp) whether the weights
changed; a CUDA graph replays none of that host code, so a captured forward either re-quantizes the weights on every
replay (the weight pass in every micro-batch) or reads copies that go stale after the next optimizer step.
`StepRefreshedWeights` moves the decision onto the device:

* one int64 counter per device (`optimizer_step_counter`), incremented by a kernel after every torch optimizer step
  (the same global step hook that moves the host stamp; a step captured in a graph captures the increment too);
* fixed FP8 buffers per layer (W's copy, and W^T's unless the layer makes it in backward) and an int64 `done`, the
  counter value the buffers were written at;
* `quantize_128x128_refresh` (csrc/kernels/quantize_128x128.cuh): the weight quantizer with a first instruction that
  returns when `*counter == *done`, then `done = counter` in stream order. Captured, the launch stays in the graph and
  decides at each replay: micro-batch 1 after a step re-quantizes, micro-batches 2..N replay a launch that exits.

The bits are the same as every other path's (the same kernel writes the same bytes). What the counter cannot see --
weights written outside an optimizer step (`load_state_dict`, a resume, a write through `.data`) -- `invalidate()`
covers (the modules call it when Megatron sets `is_first_microbatch`, eagerly); eager calls also compare the host key
(pointers, versions, the host stamp) and invalidate on a change, as `FP8WeightCache` would miss. Under capture no host
check can hold, so call `invalidate()` outside the graph after such writes.

The buffers, `done` and the counter are made by the first eager call (a tensor made during capture would be
initialised by a captured kernel, i.e. reset at every replay): run one eager forward before capturing, as Megatron's
and torch's graph helpers do with their warm-up steps. One layer, one thread (its owner's): unlike `FP8WeightCache`,
the buffers are written in place (the CUDA op bumps no version counter of them, the CPU reference's copies do: a
refresh between a forward and its backward -- which no schedule makes, the optimizer steps after every backward --
would go unnoticed by autograd on the GPU). Buffers that a captured graph holds are never freed: a call with other
shapes or another device makes new ones and keeps the old alive.
"""
import warnings
from typing import Dict, NamedTuple, Optional, Sequence

import torch

from . import ops

__all__ = ["StepRefreshedWeights", "optimizer_step_counter"]

_COUNTERS: Dict[torch.device, torch.Tensor] = {}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def optimizer_step_counter(device: torch.device) -> torch.Tensor:
    """The int64 scalar on `device` that every torch optimizer step increments (on the device, in stream order). Made
    at the first request, which must not be inside a CUDA-graph capture."""
    device = torch.device(device)
    counter = _COUNTERS.get(device)
    if counter is None:
        if _capturing():
            raise RuntimeError("the optimizer-step counter is made by an eager call: run one eager forward of the "
                               "layer before capturing it (megatron_tma.weight_refresh)")
        counter = _COUNTERS[device] = torch.zeros((), dtype=torch.int64, device=device)
    return counter


def note_optimizer_step() -> None:
    """Called by megatron_tma.autograd's global optimizer-step hook: every device's counter moves. Under capture only
    the capturing device's (a captured step increments it at every replay; a kernel on another device would run
    eagerly in the middle of the capture). A counter made after a step was captured is not in that graph: make the
    layers' first eager forward before capturing a step."""
    if _capturing():
        counter = _COUNTERS.get(torch.device("cuda", torch.cuda.current_device()))
        if counter is not None:
            counter.add_(1)
        return
    for counter in _COUNTERS.values():
        counter.add_(1)


class _Buffers(NamedTuple):
    key: tuple  # (pow2, keep_transposed, shape, dtype, device): what the buffers are shaped for
    q: torch.Tensor
    s: torch.Tensor
    qt: Optional[torch.Tensor]
    st: Optional[torch.Tensor]
    done: torch.Tensor  # int64 scalar: the counter value the buffers hold (-1: none)


class StepRefreshedWeights:
    """One layer's FP8 weight copies in fixed buffers, re-quantized on the device only after an optimizer step (module
    docstring). `get` has FP8WeightCache's signature, so a layer takes either."""

    def __init__(self) -> None:
        self._buffers: Optional[_Buffers] = None
        self._host_key: Optional[tuple] = None
        self._watch = None  # _collective_writes' watch of the weights' memory (in-place collectives move no version)
        self._captured = False  # a CUDA graph holds the current buffers
        self._retired = []  # buffers a captured graph may still write: kept alive (a reallocation must not free them)
        self._warned_copy = False

    def invalidate(self) -> None:
        """The next refresh re-quantizes (an eager device write; under capture it would be captured, i.e. re-quantize
        at every replay)."""
        if self._buffers is not None:
            self._buffers.done.fill_(-1)

    # A copy starts empty: the buffers belong to this layer's graphs.
    def __deepcopy__(self, memo) -> "StepRefreshedWeights":
        return type(self)()

    def __getstate__(self) -> dict:  # (pickling drops the buffers, as deepcopy does)
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    @torch.compiler.disable  # host bookkeeping and buffers owned across calls: not something to trace
    def get(self, weights: Sequence[torch.Tensor], pow2: bool = False, backend: str = "auto",
            keep_transposed: bool = True):
        from . import _collective_writes, autograd  # (autograd imports this module: its step hook moves the counters)

        weights = tuple(weights)
        stacked, is_view = autograd._checked_stack(weights)
        if not is_view and not self._warned_copy:
            self._warned_copy = True
            warnings.warn("step_refreshed_weights: the expert weights do not lie back to back in one storage (moved "
                          "one by one with .to()?), so every call stacks them into a copy, which a CUDA graph then "
                          "replays too: about the weight pass it is meant to skip. Build the module on its device.",
                          stacklevel=3)
        g, n, k = stacked.shape
        key = (pow2, keep_transposed, stacked.shape, stacked.dtype, stacked.device)
        capturing = _capturing()
        buffers = self._buffers
        if buffers is None or buffers.key != key:
            if capturing:
                raise RuntimeError("StepRefreshedWeights: the FP8 buffers are made by an eager call; run one eager "
                                   "forward of the layer before capturing it (megatron_tma.weight_refresh)")
            if buffers is not None and self._captured:
                self._retired.append(buffers)  # a graph captured with them may still replay: never free them
            buffers = self._buffers = self._allocate(key, g, n, k)
            self._host_key, self._captured = None, False
        if capturing:
            self._captured = True
        else:
            # What the device counter cannot see, checked eagerly as FP8WeightCache would: other memory, in-place
            # writes through the parameters (versions; weights made under inference_mode have none: always
            # refreshed), in-place collectives into them (the watch), and a step of this process.
            inference = weights[0].is_inference()
            host_key = None if inference else (tuple(w.data_ptr() for w in weights),
                                               tuple(w._version for w in weights), autograd._optimizer_step_stamp)
            if inference or host_key != self._host_key or self._watch is None or self._watch.written:
                buffers.done.fill_(-1)
                self._host_key = host_key
                self._watch = _collective_writes.watch((stacked,) if is_view else weights)
        refresh = ops.kernel("quantize_128x128_refresh", backend == "reference")
        with torch.no_grad():
            refresh(stacked, pow2, buffers.q, buffers.s, buffers.qt, buffers.st,
                    optimizer_step_counter(stacked.device), buffers.done)
        return autograd.QuantizedWeights(buffers.q, buffers.s, buffers.qt, buffers.st)

    @staticmethod
    def _allocate(key: tuple, g: int, n: int, k: int) -> _Buffers:
        keep_transposed, device = key[1], key[4]
        nb, kb = -(-n // 128), -(-k // 128)
        fp8 = dict(dtype=torch.float8_e4m3fn, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        with torch.inference_mode(False):  # never inference tensors: training saves them for backward
            return _Buffers(key, torch.empty((g, n, k), **fp8), torch.empty((g, nb, kb), **f32),
                            torch.empty((g, k, n), **fp8) if keep_transposed else None,
                            torch.empty((g, kb, nb), **f32) if keep_transposed else None,
                            torch.full((), -1, dtype=torch.int64, device=device))
