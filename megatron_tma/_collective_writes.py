"""Which cached weights an in-place collective wrote: what keeps `FP8WeightCache` from serving stale FP8 copies after a
`dist.broadcast(p, 0)` or `dist.all_reduce(p)` (issue 55, item 1).

c10d's in-place collectives (`c10d::broadcast_`, `allreduce_`, `_allgather_base_`, `recv_`, ...) do not move the
version counter of the tensors they write (their schemas carry no alias annotations, so the dispatcher's
ADInplaceOrView step never runs for them), and no optimizer step need run around them. The cache's key (pointers,
version counters, the optimizer step stamp) therefore cannot see them. Here an ADInplaceOrView kernel is registered
for every c10d op that writes its first argument: it runs the collective, then marks the cache entries whose weights'
bytes overlap a written tensor as written, so their next `get` quantizes again. That covers every caller that goes
through the dispatcher: `torch.distributed.*` (any process group, sync or async, on `p` or `p.data` or any view of
the weights' memory) and `ProcessGroup` methods (which DDP's broadcast of the parameters and its reducer use).

Why this and not the alternatives: a collective writes where it writes, whatever tensor object it is handed, so the
check is on memory (byte ranges), not on tensor objects or version counters (`p.data` has a counter of its own);
only the entries whose bytes were written go stale, so Megatron's parameter all-gathers (one per bucket per optimizer
step, into one buffer that holds every layer's weights) make each layer re-quantize once per step, never again in the
step's later micro-batches, and collectives on activations (MoE all-to-alls, tensor-parallel all-reduces) find
nothing registered for their memory and cost one dictionary lookup per written tensor; the forward pays one attribute
read (`entry.watch.written`); no host sync, no read of the weights. Nothing is registered with torch until the first
FP8 copy is cached (then for the rest of the process), so importing the package changes nothing in torch.

What stays invisible: writes that bypass torch's dispatcher (a process-group backend object called directly,
`torch.cuda.nccl`, a custom all-reduce kernel or another library's NCCL communicator), and torch builds whose c10d
ops already have an ADInplaceOrView kernel (registering ours would replace it: then none is registered). After such
a write call the layer's `invalidate_weight_cache()` (or `FP8WeightCache.invalidate()`).
"""
import threading
import weakref
from typing import Dict, Iterable, Tuple

import torch

__all__ = ["WriteWatch", "watch", "mark_written"]

# The c10d ops whose first argument is written in place (a tensor, a list of tensors or a list of lists of them).
# `send`, `barrier`, `monitored_barrier_` and `check_for_nan` write nothing. Ops a torch build lacks are skipped.
_WRITING_OPS = (
    "broadcast_", "allreduce_", "allreduce_coalesced_", "reduce_", "recv_", "recv_any_source_",
    "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_", "_allgather_base_",
    "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "_reduce_scatter_base_",
    "alltoall_", "alltoall_base_", "gather_", "scatter_",
)


class WriteWatch:
    """Set to written when an in-place collective writes any byte of the weights it watches. Held by one cache entry
    only: when the entry goes, the watch goes, and its byte ranges leave the registry with it."""

    __slots__ = ("written", "__weakref__")

    def __init__(self) -> None:
        self.written = False


# (device, storage base address) -> ((start, end, weakref to a WriteWatch), ...): the watched byte ranges in that
# storage. Replaced whole (copy on write, under the lock) so that a collective on any thread reads one snapshot.
_ranges: Dict[Tuple[torch.device, int], tuple] = {}
_lock = threading.RLock()  # re-entrant: a watch can die (its callback runs) inside a locked section
_installed = False
_library = None  # the torch.library registration; kept alive for the process (dropping it unregisters the kernels)


def _storage_key(t: torch.Tensor) -> Tuple[torch.device, int]:
    # The storage's base address from the tensor's own pointer (cheaper than materialising `untyped_storage()`).
    return t.device, t.data_ptr() - t.storage_offset() * t.element_size()


def _byte_range(t: torch.Tensor) -> Tuple[int, int]:
    """[first byte, one past the last byte) that t can address (its strided extent; empty for no elements)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _forget(key, ref) -> None:
    """Drop one dead watch's ranges (its weakref's callback)."""
    with _lock:
        kept = tuple(r for r in _ranges.get(key, ()) if r[2] is not ref)
        if kept:
            _ranges[key] = kept
        else:
            _ranges.pop(key, None)


def watch(tensors: Iterable[torch.Tensor]) -> WriteWatch:
    """A `WriteWatch` over the memory of `tensors` (the weights a cache entry was quantized from). Installs the
    collective kernels on first use. Host bookkeeping only: runs on a cache miss, never on a hit."""
    _install()
    w = WriteWatch()
    with _lock:
        for t in tensors:
            key = _storage_key(t)
            ref = weakref.ref(w, lambda r, key=key: _forget(key, r))
            start, end = _byte_range(t)
            live = tuple(r for r in _ranges.get(key, ()) if r[2]() is not None)  # (a callback raced by the lock)
            _ranges[key] = live + ((start, end, ref),)
    return w


def mark_written(tensors) -> None:
    """Mark the watches whose ranges overlap any of `tensors` (a tensor, or nested lists of them) as written."""
    if not _ranges:  # nothing cached anywhere: the common case of collectives before the first forward
        return
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            if isinstance(t, (list, tuple)):
                mark_written(t)
            continue
        if _is_fake(t):  # traced under FakeTensorMode (torch.compile): no memory, nothing written
            continue
        try:
            key = _storage_key(t)
        except RuntimeError:  # a tensor without storage (a wrapper subclass): it holds no cached weight
            continue
        watched = _ranges.get(key)
        if watched is None:  # activations and buffers that hold no cached weight: the hot case
            continue
        start, end = _byte_range(t)
        for lo, hi, ref in watched:
            if lo < end and start < hi:
                w = ref()
                if w is not None:
                    w.written = True


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and is_fake(t)


def _kernel(op):
    after = torch._C._after_ADInplaceOrView_keyset

    def run(keyset, *args, **kwargs):
        try:
            return op.redispatch(keyset & after, *args, **kwargs)
        finally:  # also after an error: the collective may have written part of its outputs
            if args:
                mark_written(args[0])

    return run


def _install() -> None:
    global _installed, _library
    if _installed:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        import torch.distributed  # (registers the c10d ops)

        if not torch.distributed.is_available():  # a torch built without distributed: no collectives to watch
            return

        library = torch.library.Library("c10d", "IMPL")
        for name in _WRITING_OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is None or "default" not in packet.overloads():
                continue
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{name}", "ADInplaceOrView"):
                continue  # torch's own (it would move the version counter); never replace it
            library.impl(name, _kernel(packet.default), "ADInplaceOrView", with_keyset=True)
        _library = library
