"""The FP8 grouped linear layer as an autograd Function: `Y_g = X_g . W_g^T` for G groups of rows, unpadded.

Forward quantizes X (1x128) and runs the M-grouped GEMM against the 128x128-quantized weights; it saves for
backward the column-quantized X (per-group 128x1 token blocks, FP8, as wgrad reads it) instead of the BF16 X.
Backward quantizes dY once (one pass) as 1x128 rows for dgrad (`dX = dY . W`, the M-grouped GEMM on the W^T copy) and as
per-group 128x1 columns for wgrad (`dW_g = dY_g^T . X_g`, the K-grouped GEMM). docs/design.md §3 fixes every rounding,
so the padded layout gives the same bits (tests/test_autograd.py, tests/test_mlp_gpu.py).

Weights are one stacked `[G, N, K]` tensor or G `[N, K]` tensors (Transformer Engine's `GroupedLinear` layout,
which keeps Megatron checkpoints interchangeable). G separate tensors that lie back to back in one storage (as
`megatron_tma.mlp` allocates them) are used through a free `[G, N, K]` view; otherwise they are stacked once per
quantization (a transient BF16 copy), which the cache below makes once per weight version.

Weight gradients (Megatron's convention): a weight with a `main_grad` attribute (a tensor of its shape, FP32 or
BF16) gets its gradient accumulated there. If it also has `grad_added_to_main_grad` (set by Megatron's DDP), that
flag is set to True and the Function returns an uninitialized dummy gradient (zeros if `zero_out_wgrad`), as
Megatron's own linears do: DDP's hook on the weight's AccumulateGrad node requires one when it overlaps the gradient
reduction, reads the flag, does not add it, and clears `.grad`. Otherwise the Function returns None for it and
`.grad` stays None. Weights without `main_grad` get a gradient of their own dtype in `.grad`.
Either all weights of one call carry `main_grad` or none. FP32 `main_grad`s that form one `[G, N, K]` block (one
tensor, or G tensors back to back in expert order, as Megatron's grad buffer lays out consecutive parameters) are
accumulated by the K-grouped GEMM itself (`D = C + dY^T . X` in FP32); otherwise the GEMM writes an FP32
`[G, N, K]` temporary that one foreach add folds into them (for FP32 the same sums bit for bit, except that an
empty group turns a -0 into +0; for BF16 one rounding of the FP32 sum).

Backends: every quantizer and GEMM is a torch op whose kernel the tensors' device picks (megatron_tma.ops);
`backend="reference"` runs the reference on any device, `"cuda"` insists on the CUDA kernels. No host read of the
group tensor happens here (the reference reads it inside its kernels), so on a GPU the forward and backward are
CUDA-graph capturable and free of host synchronisation, and `torch.compile(fullgraph=True)` traces them (the ops'
fake kernels; tests/test_compile_fullgraph.py).
"""
import itertools
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _collective_writes, gemm, ops, quant, weight_refresh
from . import permutation as _permutation
from ._validate import (check_aligned16, check_bool, check_same_device, check_tensor, misalignment16,
                        not_twice_differentiable)
from .groups import Groups, check_groups
from .limits import K_GROUPED_MAX_GROUPS, check_num_groups
from .wgrad_deferral import PendingWgrad, WgradDeferral

__all__ = [
    "QuantizedWeights",
    "FP8WeightCache",
    "quantize_weights",
    "fp8_grouped_linear",
    "stacked_view",
    "stack_weights",
    "check_linear_args",
    "quantized_weights",
    "linear_backward",
    "forward_keeping_columns",
    "quantize_output_grad",
    "weight_grads",
    "dgrad",
    "linear_forward",
    "checked_linear",
]

from ._ext import check_backend  # noqa: E402  (one check of the backend for every entry)
WEIGHT_DTYPES = (torch.bfloat16,)
MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)

Weights = Union[torch.Tensor, Sequence[torch.Tensor]]


class QuantizedWeights(NamedTuple):
    """The FP8 operands of one set of G weights (docs/layouts.md, 128x128 weights)."""

    q: torch.Tensor  # e4m3 [G, N, K]: forward
    s: torch.Tensor  # FP32 [G, N/128, K/128]
    qt: Optional[torch.Tensor]  # e4m3 [G, K, N]: the same bytes transposed, for dgrad (None: not kept)
    st: Optional[torch.Tensor]  # FP32 [G, K/128, N/128]


def transposed_weights(q: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(qt, st) from (q, s): with one scale per 128x128 block, W^T's FP8 copy is W's bytes transposed and its scales
    W's transposed (quantize_128x128 writes both from one read), so dgrad's operand can be made from the forward's
    copy, bit for bit, when it is not kept (`keep_transposed_weight=False`: a 1-byte transpose in backward instead of
    W^T held from the forward to its layer's backward). The `transpose_128x128` op: on a GPU its CUDA kernel (one pass,
    2 bytes of traffic per weight; torch's strided byte copy, which it replaced, added ~4 ms a backward on
    Qwen3-30B-A3B's 128-expert layer), on the CPU the reference's transposes."""
    return ops.kernel("transpose_128x128")(q, s)


# --------------------------------------------------------------------------------------------------------------
# Weight stacking
# --------------------------------------------------------------------------------------------------------------


def stacked_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A `[G, *shape]` view of G same-shaped contiguous tensors that lie back to back, in order, in one storage.

    Returns None when they do not (then a caller must copy). Reads only metadata, cheaply: it sits on every
    call's path with G up to hundreds. Adjacent pointers inside the first tensor's storage mean one storage
    (two live storages never overlap). The view is detached: an operand, not a node of the autograd graph.
    """
    first = tensors[0]
    shape, dtype = first.shape, first.dtype
    step = first.numel() * first.element_size()
    base = first.data_ptr()
    for i, t in enumerate(tensors):
        if t.data_ptr() != base + i * step or t.shape != shape or t.dtype != dtype or not t.is_contiguous():
            return None
    storage = first.untyped_storage()
    if base - storage.data_ptr() + len(tensors) * step > storage.nbytes():
        return None
    return first.detach().as_strided((len(tensors),) + tuple(shape), (first.numel(),) + first.stride())


class _StackWeights(torch.autograd.Function):
    """Differentiable `torch.stack` that is a free view when the weights already lie back to back."""

    @staticmethod
    def forward(ctx, *weights):
        return _checked_stack(weights)[0]

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def stack_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """G `[N, K]` tensors as one `[G, N, K]` tensor whose gradient flows back to each (a view if they are
    adjacent in one storage, else a copy). For consumers of a stacked weight such as `torch._grouped_mm`."""
    return _StackWeights.apply(*weights)


# --------------------------------------------------------------------------------------------------------------
# Weight quantization and its cache
# --------------------------------------------------------------------------------------------------------------


def _as_weights(weight: Weights) -> Tuple[torch.Tensor, ...]:
    """The weights as a tuple (a stacked weight as a 1-tuple), the first one checked (the others are checked
    when they are quantized)."""
    if isinstance(weight, torch.Tensor):
        check_tensor(weight, "weight", WEIGHT_DTYPES, dim=3)
        return (weight,)
    weights = tuple(weight)
    if not weights:
        raise ValueError("weight must be a [G, N, K] tensor or a non-empty sequence of G [N, K] tensors")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"weight {i} must be a torch.Tensor (weight: a [G, N, K] tensor or a sequence of G "
                            f"[N, K] tensors), got {type(w).__name__}")
    if len(weights) == 1 and isinstance(weights[0], torch.Tensor) and weights[0].dim() == 3:
        check_tensor(weights[0], "weight", WEIGHT_DTYPES, dim=3)
    else:
        check_tensor(weights[0], "weight 0", WEIGHT_DTYPES, dim=2, contiguous=False)
    return weights


def _check_weights(weights: Tuple[torch.Tensor, ...]) -> None:
    """G [N, K] tensors of one shape, dtype and device (any strides: they are stacked if not adjacent)."""
    first = weights[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.shape != shape or w.dtype != dtype or w.device != device:
            got = f"{tuple(w.shape)} {w.dtype} on {w.device}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(
                f"all weights must have one shape, dtype and device: weight 0 is {tuple(shape)} {dtype} on "
                f"{device}, weight {i} is {got}"
            )


def _checked_stack(weights: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, bool]:
    """(the weights as one detached `[G, N, K]` tensor, whether it is a view of their own memory). A stacked view
    proves the weights alike (one shape, dtype and storage), so the per-weight check runs only before a copy."""
    if len(weights) == 1 and weights[0].dim() == 3:
        return weights[0].detach(), True
    view = stacked_view(weights)
    if view is not None:
        return view, True
    _check_weights(weights)
    return torch.stack([w.detach() for w in weights]), False


def quantize_weights(weight: Weights, pow2: bool = False, backend: str = "auto") -> QuantizedWeights:
    """128x128-block FP8 copies of G weights (one `[G, N, K]` tensor or G `[N, K]` tensors), with the transposed
    copy that dgrad multiplies with."""
    stacked, _ = _checked_stack(_as_weights(weight))
    return _quantize_stacked(stacked, pow2, backend)


def _quantize_stacked(stacked: torch.Tensor, pow2: bool, backend: str) -> QuantizedWeights:
    with torch.no_grad():
        q, s, qt, st = quant.quantize_128x128(stacked, pow2, backend=backend)
    return QuantizedWeights(q, s, qt, st)


def _kept(value: QuantizedWeights, keep_transposed: bool) -> QuantizedWeights:
    return value if keep_transposed else value._replace(qt=None, st=None)


def quantized_weights(weights: Tuple[torch.Tensor, ...], cache: Optional["FP8WeightCache"], pow2: bool,
                      backend: str, keep_transposed: bool = True) -> QuantizedWeights:
    """The weights' FP8 copies: from the layer's cache, or made now when there is none. Code that torch.compile traces
    quantizes them every call: the cache's bookkeeping (data pointers, version counters) is host state a graph cannot
    hold, and the copies are the same bits either way. `keep_transposed=False`: qt and st are None (not held)."""
    if cache is None or torch.compiler.is_compiling():
        return _kept(quantize_weights(weights, pow2, backend), keep_transposed)
    return cache.get(weights, pow2, backend, keep_transposed)


def dgrad_operands(ctx, q, s, qt, st, need_dx):
    """What a Function saves for dgrad: (qt, st), or (q, s) when W^T is not kept (backward transposes them, noted on
    ctx), or (None, None) when no input gradient is wanted. Saving q costs nothing: the cache holds it already."""
    ctx.transpose_in_backward = need_dx and qt is None
    if not need_dx:
        return None, None
    return (q, s) if qt is None else (qt, st)


# Optimizer steps. Version counters do not see every weight update: torch's fused optimizers (`Adam`, `AdamW`, `SGD`,
# `Adagrad` with `fused=True`) write the parameters without moving them, and so does any optimizer that writes
# through `p.data` (Megatron's copy of its main params, a user's own). So the cache key also holds a process-wide
# step stamp that a global optimizer post-step hook moves after every `step()` of every `torch.optim.Optimizer`
# (every optimizer torch ships, fused, foreach or not, and every subclass: the hook runs in the base class's step
# wrapper), whatever it writes through. Why this and not the alternatives: it costs one global read per forward and
# the forward stays sync-free and capturable; a device-side fingerprint of the weights would read all of them on
# every forward (half a quantization's traffic) and deciding on it needs a host sync; a step makes every cache in
# the process miss once, which a step's new weights need anyway. Writes through `.data` outside any optimizer
# step stay invisible (nothing host-side changes): call `invalidate()` after them.
# The stamp is set from a counter (`next` is atomic): every step writes a value never written before, so a step that
# overlaps a forward in another thread cannot leave the stamp where that forward read it.
_step_counter = itertools.count(1)
_optimizer_step_stamp = 0


def _note_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_step_stamp
    _optimizer_step_stamp = next(_step_counter)
    weight_refresh.note_optimizer_step()  # the device counters that StepRefreshedWeights' kernels read


_optimizer_step_hook = register_optimizer_step_post_hook(_note_optimizer_step)


class _CacheEntry(NamedTuple):
    """One immutable snapshot of an FP8WeightCache: what it was made from and the copies."""

    key: tuple
    aliases: Tuple[torch.Tensor, ...]
    value: QuantizedWeights
    watch: _collective_writes.WriteWatch  # set when an in-place collective writes the weights' memory


class FP8WeightCache:
    """The FP8 copies of one set of weights, re-made only when the weights change (once per optimizer step).

    The key is every weight's data pointer and version counter, the process's optimizer step stamp (above), plus
    the first weight's shape, dtype and device and the scale mode (strides are not part of it: a weight re-viewed
    in place is not seen). The version counter moves with every in-place write through the parameter or a view of
    it (`load_state_dict`, `with torch.no_grad(): w.add_(...)`, non-fused optimizers); the step stamp moves after
    every torch optimizer step, fused ones included, whatever it writes through (so is a write between a step and
    the next forward, such as Megatron's copy of its main params into the parameter buffer). Neither sees a write
    through `w.data` or through another tensor that shares the memory with no optimizer step since the last `get`
    (a manual `w.data.add_()`): after such an update call `invalidate()`; `megatron_tma.mlp`'s modules do so
    whenever Megatron sets their `is_first_microbatch` flag, as it does for Transformer Engine's modules.

    In-place collectives (`dist.broadcast(p, 0)`, `dist.all_reduce(p)`, Megatron's parameter all-gathers, DDP's
    broadcast of the parameters) move neither: the entry watches the bytes of its weights, and any c10d collective
    that writes one of them marks it written, so the next `get` quantizes again (megatron_tma._collective_writes:
    host bookkeeping on the collective's side, one attribute read here; writes that bypass torch's dispatcher still
    need `invalidate()`).

    The entry holds a detached alias of every weight, so that while it lives the memory of a replaced weight
    cannot be handed to a new tensor that would then match the old pointer and version. Under CUDA-graph capture
    a hit records no quantization: invalidate before capturing if the graph must re-quantize on replay.
    One cache belongs to one layer (its owner), never to the process.

    Evaluation: a miss inside `torch.inference_mode()` quantizes outside it (`inference_mode(False)`), so the copies
    are never inference tensors and the training forward that follows can reuse them (save them for backward); under
    `no_grad` the copies are ordinary tensors anyway. An eval loop between two training steps changes nothing that
    training computes.
    Copies: a hit also needs the entry's aliases to lie at the key's pointers, so an entry cannot be satisfied by a
    different tensor that landed on memory the entry does not hold (a deep-copied entry holds copies, not the
    memory); `copy.deepcopy` and pickling drop the entry altogether (the copy quantizes at its first forward).

    Threads: `get` and `invalidate` may be called from any number of threads at once (nn.DataParallel's replicas,
    a serving thread pool). The entry is one immutable snapshot (key, aliases, copies) that `get` reads once and
    replaces whole, and `invalidate` drops: a single attribute read or write each, atomic, so every `get` returns
    the copies of the weights it was given, with no lock on the per-forward path. Two threads that miss at once
    both quantize (the later snapshot stays).
    """

    def __init__(self) -> None:
        self._entry: Optional[_CacheEntry] = None

    def invalidate(self) -> None:
        """Drop the FP8 copies; the next `get` quantizes again."""
        self._entry = None

    # A copy of a cache starts empty: its entry's key names the original's memory, which a copy does not hold.
    def __deepcopy__(self, memo) -> "FP8WeightCache":
        return type(self)()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entry = None

    @torch.compiler.disable  # host-side bookkeeping (pointers, versions): a graph break, not something to trace
    def get(self, weights: Sequence[torch.Tensor], pow2: bool = False, backend: str = "auto",
            keep_transposed: bool = True) -> QuantizedWeights:
        """The FP8 copies of `weights` (a `[G, N, K]` tensor in a 1-tuple, or G `[N, K]` tensors), quantized now
        if any weight changed. The weights are checked when they are quantized; a hit proves them unchanged, so
        the per-call host cost is one pointer and one version read per weight. `keep_transposed=False`: the entry
        holds W's copy only (qt and st None; `transposed_weights` makes them when dgrad needs them)."""
        first = weights[0]
        if first.is_inference():  # weights made under inference_mode have no version counter: never cached
            return _kept(quantize_weights(tuple(weights), pow2, backend), keep_transposed)
        key = (pow2, keep_transposed, first.shape, first.dtype, first.device, tuple(w.data_ptr() for w in weights),
               tuple(w._version for w in weights), _optimizer_step_stamp)
        entry = self._entry  # the one read of the shared state: another thread may replace it from here on
        # (the aliases at the key's pointers: the entry holds that memory, so no other tensor can lie there)
        if (entry is not None and entry.key == key and not entry.watch.written
                and all(a.data_ptr() == p for a, p in zip(entry.aliases, key[5]))):
            return entry.value
        del entry
        self._entry = None  # free the stale copies before making new ones: one copy at a time at the peak
        # never inference tensors in the cache: a training forward after an eval under inference_mode reuses them
        with torch.inference_mode(False):
            stacked, is_view = _checked_stack(tuple(weights))
            # A view of the weights' own storage keeps all of their memory alive with one alias (G detaches
            # cost ~0.4 us each on every miss); a stacked copy does not, so then every weight is aliased.
            aliases = (stacked,) if is_view else tuple(w.detach() for w in weights)
            # Watched before they are read: a collective that writes them from here on (another thread) marks
            # the entry written (module docstring of _collective_writes).
            watch = _collective_writes.watch(aliases)
            value = _kept(_quantize_stacked(stacked, pow2, backend), keep_transposed)
        self._entry = _CacheEntry(key, aliases, value, watch)
        return value

    # The snapshot's parts, read-only (tests and tools look at them).
    @property
    def _key(self):
        entry = self._entry
        return None if entry is None else entry.key

    @property
    def _aliases(self) -> Tuple[torch.Tensor, ...]:
        entry = self._entry
        return () if entry is None else entry.aliases

    @property
    def _value(self) -> Optional[QuantizedWeights]:
        entry = self._entry
        return None if entry is None else entry.value


# --------------------------------------------------------------------------------------------------------------
# The autograd Function
# --------------------------------------------------------------------------------------------------------------

# Positions in forward's inputs (x, groups, q, s, qt, st, rows, token_rows, out_rows, out_token_rows, backend, pow2,
# deferral, *weights) of x and the first weight.
_X, _WEIGHTS = 0, 13


def linear_forward(x, groups, q, s, backend, pow2):
    """Y = grouped(X . W^T) in FP8: X quantized 1x128, the M-grouped GEMM; nothing kept for backward."""
    xq, xs = quant.run_1x128(x, pow2, backend)
    return gemm.run_m_grouped(xq, xs, q, s, groups, backend=backend)


def forward_keeping_columns(x, groups, q, s, rows, need_dw, backend, pow2):
    """(Y, X's per-group FP8 columns and their scales) of `Y = grouped(X . W^T)`, X = `x[rows]` with `rows`: with
    `need_dw` the columns wgrad reads come from the same read of x as the rows the GEMM reads (X is not kept in
    BF16), else (Y, None, None)."""
    if not need_dw:
        return linear_forward(x if rows is None else x.index_select(0, rows), groups, q, s, backend, pow2), None, None
    if rows is None:
        xq, xs, xt, xt_s = quant.run_1x128_and_grouped_128x1(x, groups, pow2, backend)
    else:  # the permutation fused into the read of the routed tokens
        xq, xs, xt, xt_s = quant.run_gather_1x128_and_grouped_128x1(x, rows, groups, pow2, backend)
    return gemm.run_m_grouped(xq, xs, q, s, groups, backend=backend), xt, xt_s


class _FP8GroupedLinear(torch.autograd.Function):
    """y = grouped(x . W^T); the weights come in pre-quantized (q, s, qt, st) and, after the options, as the
    parameters themselves, only so that their gradients (or `main_grad`s) can be routed. With `rows` (a
    megatron_tma.permutation.Permutation's two tensors), x is the routed tokens in their own order and the GEMM's
    rows are `x[rows]`, gathered by the quantizer; x's gradient is then the rows' gradients combined per token.
    With `out_rows` (another Permutation's), the output is the GEMM's rows combined per token, and backward gathers
    the output gradient's rows inside dY's quantizer."""

    @staticmethod
    def forward(ctx, x, groups, q, s, qt, st, rows, token_rows, out_rows, out_token_rows, backend, pow2, deferral,
                *weights):
        need_dx = ctx.needs_input_grad[_X]
        y, xt, xt_s = forward_keeping_columns(x, groups, q, s, rows, any(ctx.needs_input_grad[_WEIGHTS:]), backend,
                                              pow2)
        if out_token_rows is not None:
            y = _permutation.run_combine_rows(y, out_token_rows, backend)
        ctx.backend, ctx.pow2, ctx.groups_meta, ctx.deferral = backend, pow2, groups[1:], deferral
        ctx.save_for_backward(groups.tensor, xt, xt_s, *dgrad_operands(ctx, q, s, qt, st, need_dx),
                              token_rows if need_dx else None, out_rows, *weights)
        return y

    @staticmethod
    @not_twice_differentiable("fp8_grouped_linear")
    def backward(ctx, dy):
        groups, xt, xt_s, qt, st, token_rows, out_rows, *weights = ctx.saved_tensors
        dx, wgrads = linear_backward(dy, Groups(groups, *ctx.groups_meta), xt, xt_s, (qt, st), weights,
                                     ctx.needs_input_grad[_X], ctx.needs_input_grad[_WEIGHTS:], ctx.backend, ctx.pow2,
                                     dy_rows=out_rows, deferral=ctx.deferral,
                                     transpose_in_backward=ctx.transpose_in_backward)
        if dx is not None and token_rows is not None:
            dx = _permutation.run_combine_rows(dx, token_rows, ctx.backend)
        return (dx,) + (None,) * (_WEIGHTS - 1) + tuple(wgrads)


def linear_backward(dy, groups: Groups, xt, xt_s, dgrad_w, weights, need_dx, needs_dw, backend, pow2, dy_rows=None,
                    deferral: Optional[WgradDeferral] = None, transpose_in_backward: bool = False):
    """(dX or None, the weights' gradients as `weight_grads` routes them) of `Y = grouped(X . W^T)`, from dY and
    what the forward kept: X's per-group columns (xt, xt_s; None if no weight wants a gradient) and dgrad's weights
    `dgrad_w` (what `dgrad_operands` saved: the W^T copy (qt, st), or with `transpose_in_backward` W's (q, s), turned
    into W^T just before the dgrad GEMM; (None, None) if X wants no gradient). `groups` is the forward's checked
    description. `dy_rows`: dY's rows are `dy[dy_rows]` (the gradient of a combined output), gathered by the quantizer
    when it makes both forms. `deferral`: the weight gradient's operands are kept there (no gradient returned) until
    `flush_wgrad`. Memory: the weight gradient runs first and dY's columns are freed before dX is allocated (the
    backward's peak holds one of them, not both; the two GEMMs are independent, so the bits are the same in either
    order), and a made W^T lives for the dgrad GEMM only."""
    dyq, dy_s, dy_cols = quantize_output_grad(dy, groups, need_dx, xt is not None, pow2, backend, dy_rows)
    wgrads = [None] * len(weights)
    if xt is not None:
        wgrads = weight_grads(weights, needs_dw, dy_cols, [xt, xt_s], groups, backend, deferral)
    dx = dgrad(dyq, dy_s, dgrad_w, groups, backend, transpose_in_backward) if need_dx else None
    return dx, wgrads


def quantize_output_grad(dy, groups: Groups, need_dx, need_dw, pow2, backend, dy_rows=None):
    """dY's FP8 forms the backward reads, in one pass when both are wanted: (rows, their scales) for dgrad (None, None
    if X wants no gradient) and a list [per-group columns, their scales] for wgrad (empty if no weight wants one: a
    list so that `weight_grads` can drop them). `dy_rows` as `linear_backward`'s."""
    dy = dy.contiguous()
    if misalignment16(dy):  # (autograd may hand a view at any offset; the quantizers read 16-byte vectors)
        dy = dy.clone()
    if dy_rows is not None and not (need_dx and need_dw):
        dy = dy.index_select(0, dy_rows)
    # (lists built element by element: torch.compile's tracer of torch 2.11 takes a starred target for a tuple)
    dyq = dy_s = None
    cols = []
    if need_dx and need_dw and dy_rows is not None:
        dyq, dy_s, dyt, dyt_s = quant.run_gather_1x128_and_grouped_128x1(dy, dy_rows, groups, pow2, backend)
        cols = [dyt, dyt_s]
    elif need_dx and need_dw:
        dyq, dy_s, dyt, dyt_s = quant.run_1x128_and_grouped_128x1(dy, groups, pow2, backend)
        cols = [dyt, dyt_s]
    elif need_dx:
        dyq, dy_s = quant.run_1x128(dy, pow2, backend)
    elif need_dw:
        dyt, dyt_s = quant.run_grouped_128x1(dy, groups, pow2, backend)
        cols = [dyt, dyt_s]
    return dyq, dy_s, cols


def weight_grads(weights, needs_dw, dy_cols: list, x_cols: list, groups: Groups, backend,
                 deferral: Optional[WgradDeferral] = None):
    """The weights' gradients as backward returns them (`_weight_grads`: to `.grad`, or accumulated into
    `main_grad`), from dY's and X's per-group columns, each handed over as a list [columns, scales] that this empties,
    so that an operand nobody else holds is freed as soon as the GEMM (or the deferral's combine) has read it.
    `deferral`: the operands are kept there until its last backward (or `flush_wgrad`)."""
    pending = PendingWgrad(*dy_cols, *x_cols, groups)
    dy_cols.clear()
    x_cols.clear()
    if deferral is None:
        return _weight_grads(weights, needs_dw, *pending[:4], groups, backend)
    deferral.add(pending, tuple(needs_dw))
    del pending  # (the deferral holds them; its combine frees each source once copied)
    if deferral.due():  # the step's last backward (Megatron's last micro-batch): every pending one, now
        item, _ = deferral.take()
        return _weight_grads(weights, needs_dw, item.dyt, item.dyt_s, item.xt, item.xt_s, item.groups, backend)
    if getattr(weights[0], "main_grad", None) is not None:
        return _main_grad_placeholders(weights, needs_dw)  # DDP's hooks see a gradient per micro-batch
    return [None] * len(weights)


def dgrad(dyq, dy_s, dgrad_w, groups: Groups, backend, transpose_in_backward: bool = False):
    """dX = grouped(dY . W) on dY's 1x128 rows: `dgrad_w` the W^T copy (qt, st), or W's (q, s) transposed here
    (`transpose_in_backward`), the copy freed with the call."""
    qt, st = transposed_weights(*dgrad_w) if transpose_in_backward else dgrad_w
    return gemm.run_m_grouped(dyq, dy_s, qt, st, groups, backend=backend)


def flush_wgrad(deferral: WgradDeferral, weights: Sequence[torch.Tensor], backend: str = "auto") -> int:
    """Compute the weight gradients `deferral` holds in one K-grouped GEMM (megatron_tma.wgrad_deferral) and route
    them as a backward would have: added into each weight's `main_grad` (FP32 accumulated in the GEMM), else into
    its `.grad`. Returns how many backwards it held (0: nothing pending, nothing done)."""
    if not len(deferral):
        return 0
    # into main_grad the GEMM accumulates whatever `needs` says; no dummy gradient for DDP's hooks is wanted here
    needs = (False,) * len(weights) if getattr(weights[0], "main_grad", None) is not None else deferral.needs
    item, count = deferral.take()
    grads = _weight_grads(tuple(weights), needs, item.dyt, item.dyt_s, item.xt, item.xt_s, item.groups, backend)
    with torch.no_grad():
        for w, g in zip(weights, grads):
            if g is not None and getattr(w, "main_grad", None) is None:  # (main_grad's path returns dummies)
                w.grad = g if w.grad is None else w.grad + g
    return count


def _weight_grads(weights, needs, dyt, dyt_s, xt, xt_s, groups, backend):
    """Route dW = dY^T . X to `.grad` (returned) or into `main_grad` (accumulated; None returned)."""

    def wgrad(**kw):
        return gemm.run_k_grouped(dyt, dyt_s, xt, xt_s, groups, backend=backend, **kw)

    main = [getattr(w, "main_grad", None) for w in weights]
    if all(m is None for m in main):
        dw = wgrad(out_dtype=weights[0].dtype)
        grads = (dw,) if len(weights) == 1 else dw.unbind(0)
        return [g if need else None for g, need in zip(grads, needs)]
    if any(m is None for m in main):
        raise ValueError("either every weight of a grouped linear has a main_grad attribute or none has")
    shape = weights[0].shape
    for i, m in enumerate(main):
        check_tensor(m, f"main_grad of weight {i}", MAIN_GRAD_DTYPES, device=weights[i].device, contiguous=False)
        if m.shape != shape:
            raise ValueError(
                f"main_grad of weight {i} must have the weight's shape {tuple(shape)}, got {tuple(m.shape)}"
            )
    target = None
    if main[0].dtype == torch.float32:  # the GEMM accumulates FP32 in place: D = C + A.B
        target = main[0] if len(main) == 1 else stacked_view(main)
    if target is not None and target.is_contiguous():
        wgrad(out=target, accumulate=True)
    else:  # BF16 main_grads, or FP32 ones that are not one [G, N, K] block: one FP32 result, added once
        dw = wgrad(out_dtype=torch.float32)
        torch._foreach_add_(main, [dw] if len(main) == 1 else list(dw.unbind(0)))
    return _main_grad_placeholders(weights, needs)


def _main_grad_placeholders(weights, needs):
    """What backward hands autograd for weights whose gradient goes (or went, or will go: deferred) into `main_grad`:
    for Megatron DDP's weights a dummy, flagged as already added; None for the others."""
    grads = []
    for w, need in zip(weights, needs):
        if hasattr(w, "grad_added_to_main_grad"):  # Megatron's DDP owns this weight
            w.grad_added_to_main_grad = True
            # DDP's hook on the weight's AccumulateGrad node requires a gradient when it overlaps the gradient
            # reduction (`param.grad being None is not safe`); like Megatron's own linears, hand it a dummy that it
            # drops without adding (grad_added_to_main_grad), zeros if the weight asks for them.
            dummy = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
            grads.append(dummy(w.shape, dtype=w.dtype, device=w.device) if need else None)
        else:
            grads.append(None)
    return grads


def check_linear_args(x: torch.Tensor, weight: Weights, groups, backend: str, pow2_scales: bool,
                      x_name: str = "x", x_contiguous: bool = True) -> Tuple[Tuple[torch.Tensor, ...], Groups]:
    """`fp8_grouped_linear`'s argument checks (TypeError / ValueError naming the argument); returns the weights as a
    tuple and the checked groups, which every quantizer and GEMM of the call (forward and backward) then takes as
    they are. A caller that computes the input itself passes a stand-in of its shape as x (`x_name` names it, and
    `x_contiguous=False` lets it be a view)."""
    check_backend(backend)
    if not isinstance(pow2_scales, bool):
        raise TypeError(f"pow2_scales must be a bool, got {type(pow2_scales).__name__}")
    weights = _as_weights(weight)
    check_tensor(x, x_name, (torch.bfloat16,), dim=2, contiguous=x_contiguous)
    check_same_device(**{x_name: x, "groups": groups.tensor if type(groups) is Groups else groups,
                         "weight": weights[0]})
    n, k = weights[0].shape[-2:]
    g = weights[0].shape[0] if len(weights) == 1 and weights[0].dim() == 3 else len(weights)
    if x.shape[1] != k:
        raise ValueError(f"{x_name} is [M, K] = {list(x.shape)} but the weights are [N, K] = {[n, k]}: K differs")
    if n % 128 != 0 or k % 128 != 0 or n == 0 or k == 0:
        raise ValueError(
            f"N and K must be positive multiples of 128 (the forward contracts over K and dgrad over N in "
            f"128-wide FP8 scaling blocks), got N={n}, K={k}"
        )
    check_num_groups(g, "M_GROUPED_MAX_GROUPS", "fp8_grouped_linear (the forward's m_grouped_fp8_gemm)")
    if g > K_GROUPED_MAX_GROUPS and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        check_num_groups(g, "K_GROUPED_MAX_GROUPS", "fp8_grouped_linear (the weight gradient's k_grouped_fp8_gemm)")
    if x_contiguous and x.numel():  # what the quantizers need of it (an x computed by the caller is a fresh tensor)
        check_aligned16(x, x_name, "the quantizers read rows as 16-byte vectors")
    groups = check_groups(groups, g, m_total=x.shape[0])  # (its device: checked with x's above)
    check_backend(backend, x.device)
    return weights, groups


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: Weights,
    groups: torch.Tensor,
    *,
    cache: Optional[FP8WeightCache] = None,
    backend: str = "auto",
    pow2_scales: bool = False,
    permutation: Optional[_permutation.Permutation] = None,
    combine: Optional[_permutation.Permutation] = None,
    keep_transposed_weight: bool = True,
    wgrad_deferral: Optional[WgradDeferral] = None,
) -> torch.Tensor:
    """`y[rows of g] = x[rows of g] . W_g^T` in FP8 (docs/design.md §3), with gradients for x and the weights.

    x: bf16 `[M, K]`, contiguous. weight: bf16 `[G, N, K]`, or a sequence of G bf16 `[N, K]` tensors.
    groups: int32/int64 sizes `[G]` or offsets `[G+1]` on x's device (never read on the host by the CUDA backend;
    on the CPU they are checked to describe M rows), or a `megatron_tma.groups.Groups` from `check_groups`. N and K
    must be multiples of 128: the forward contracts over K and dgrad over N in 128-wide scaling blocks. cache: the
    layer's `FP8WeightCache` (None: quantize the weights on every call). pow2_scales: power-of-two (UE8M0) scales
    everywhere. Returns bf16 `[M, N]`. See the module docstring for where the weight gradients go.
    permutation: a `megatron_tma.permutation.Permutation`; x is then the routed tokens `[T, K]` in their own order,
    the M rows are `x[permutation.rows]` (gathered by the quantizer, never copied in BF16, when a weight wants a
    gradient: the row + column quantizer runs then; otherwise an `index_select`) and x's gradient is
    their gradients combined per token (`megatron_tma.permutation.combine_rows`' sum).
    combine: a `Permutation` of the M rows; the output is then the tokens `[T, N]`, each the `combine_rows` sum of its
    rows, and backward gathers the tokens' gradient rows inside dY's quantizer (never a BF16 copy of them).
    keep_transposed_weight: True keeps dgrad's W^T copy from the forward (in the cache, with W's); False keeps W's
    only and makes W^T in backward by transposing it (the same bits; memory for a 1-byte transpose per backward).
    wgrad_deferral: a `megatron_tma.wgrad_deferral.WgradDeferral`; backward then keeps the weight gradient's FP8
    operands there instead of computing it, and `flush_wgrad` computes every pending one in one GEMM.
    """
    if permutation is None:
        weights, groups = check_linear_args(x, weight, groups, backend, pow2_scales)
        rows = token_rows = None
    else:
        check_tensor(x, "x", (torch.bfloat16,), dim=2)
        if x.numel():
            check_aligned16(x, "x", "the quantizers read rows as 16-byte vectors")
        rows, token_rows = _permutation.check_permutation(permutation, None, x)
        # The checks see the gathered matrix's shape through a stand-in; the quantizer reads x itself.
        weights, groups = check_linear_args(x.new_empty(1, 1).expand(rows.shape[0], x.shape[1]), weight, groups,
                                            backend, pow2_scales, x_name="x[permutation.rows]", x_contiguous=False)
    out_rows = out_token_rows = None
    if combine is not None:
        m = x.shape[0] if rows is None else rows.shape[0]
        out_rows, out_token_rows = _permutation.check_permutation(combine, m, None, "combine", device=x.device)
    check_bool(keep_transposed_weight, "keep_transposed_weight")
    wq = quantized_weights(weights, cache, pow2_scales, backend, keep_transposed_weight)
    return checked_linear(x, groups, wq, rows, token_rows, out_rows, out_token_rows, backend, pow2_scales,
                          wgrad_deferral, weights)


def checked_linear(x, groups: Groups, wq: QuantizedWeights, rows, token_rows, out_rows, out_token_rows, backend, pow2,
                   deferral, weights) -> torch.Tensor:
    """`fp8_grouped_linear` on arguments it (or a caller with the same rules, megatron_tma.mlp_function) checked:
    the Function where a gradient is wanted, else the forward's kernels alone (inference: nothing to save)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in weights)):
        y = forward_keeping_columns(x, groups, wq.q, wq.s, rows, False, backend, pow2)[0]
        return y if out_token_rows is None else _permutation.run_combine_rows(y, out_token_rows, backend)
    return _FP8GroupedLinear.apply(x, groups, wq.q, wq.s, wq.qt, wq.st, rows, token_rows, out_rows, out_token_rows,
                                   backend, pow2, deferral, *weights)
