"""The MoE permutation owned by the experts: routed tokens in, combined tokens out, no permuted BF16 copy.

Megatron's token dispatcher permutes the routed tokens `[T, H]` into one row per (token, chosen expert), grouped by
expert (`[T k, H]`, a BF16 copy), hands that to the experts, and un-permutes their output by a scatter-add. The
FP8 experts then read the permuted copy once, to quantize it. Here the experts take the tokens in their own order
with a `Permutation` and:
* forward: quantize the permuted rows straight from the tokens (the gather fused into the first linear's row +
  column quantizer: `gather_quantize_1x128_and_grouped_128x1`), so the permuted BF16 copy is never written or
  read again; and combine their output rows into tokens themselves (`combine_rows`);
* backward: the combine's gradient is the gather `dY[r] = dOut[rows[r]]`, read by the second linear's row + column
  quantizer straight from the tokens' gradient (fused as in forward: no BF16 copy of dY), and the first linear's
  input gradient comes back combined per token (`combine_rows` again), as the permutation's backward would.

`combine_rows` adds each token's k rows in FP32 in one fixed order (its experts in ascending order, from +0) and
rounds once: deterministic, so the unpadded experts and their padded twins, which produce the same rows, also
produce the same combined bits. Megatron's own un-permutation adds BF16 rows with atomics (torch path) or in FP32
per token (Transformer Engine's fused path); this is the latter's arithmetic.

`permutation_from_routing_map` builds the plan in Megatron's order (experts ascending, each expert's tokens in
token order: `megatron.core.transformer.moe.moe_utils.permute`'s), so the permuted rows, the token counts and
the permuted probs are those Megatron's dispatcher would hand the experts.
"""
from typing import NamedTuple, Optional, Tuple

import torch

from . import _ext, ops
from ._validate import check_aligned16, check_tensor, misalignment16
from .groups import debug_checks_enabled

__all__ = ["Permutation", "permutation_from_routing_map", "check_permutation", "check_permutation_values",
           "combine_rows", "gather_rows", "COMBINE_MAX_ROWS_PER_TOKEN"]

COMBINE_MAX_ROWS_PER_TOKEN = 32  # kCombineMaxRowsPerToken in csrc/include/megatron_tma/host/combine_rows.h


class Permutation(NamedTuple):
    """Where each permuted row comes from and where it goes back to: `rows[token_rows[t, j]] == t` for every token t,
    each of the T k rows named once in `token_rows`. Checked where the values are free to read (CPU tensors) or
    with the debug checks on (`check_permutation`); device tensors are otherwise never read on the host."""

    rows: torch.Tensor  # int32 [T k]: the token of permuted row r (rows grouped by expert)
    token_rows: torch.Tensor  # int32 [T, k]: the permuted rows of token t, in ascending order (its experts')

    @property
    def num_tokens(self) -> int:
        return self.token_rows.shape[0]

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def permutation_from_routing_map(routing_map: torch.Tensor, topk: int, probs: Optional[torch.Tensor] = None
                                 ) -> Tuple[Permutation, torch.Tensor, Optional[torch.Tensor]]:
    """(the `Permutation`, the tokens per expert int64 `[E]`, the permuted probs `[T topk]` or None) of a routing
    map (bool `[T, E]`) in which every token picks exactly `topk` experts (Megatron's dropless top-k routing), in
    Megatron's permuted order. `probs` (`[T, E]`, the router's probs) come out permuted as Megatron permutes them.
    Fixed shapes and no host read (argsorts, as Megatron's own CUDA-graph-safe permute): a map with another number
    of experts for some token gives a wrong plan, as it gives Megatron's permute a wrong one."""
    check_tensor(routing_map, "routing_map", (torch.bool,), dim=2)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= COMBINE_MAX_ROWS_PER_TOKEN:
        raise ValueError(f"topk must be an int in [1, {COMBINE_MAX_ROWS_PER_TOKEN}], got {topk!r}")
    num_tokens, num_experts = routing_map.shape
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds the routing map's {num_experts} experts")
    if probs is not None:
        check_tensor(probs, "probs", dim=2, contiguous=False)
        if probs.shape != routing_map.shape or probs.device != routing_map.device:
            raise ValueError(f"probs must be [T, E] = {list(routing_map.shape)} on {routing_map.device}, got "
                             f"{list(probs.shape)} on {probs.device}")
    # [E, T] flattened: entry e T + t; a stable descending sort puts the chosen entries first, expert by expert,
    # tokens ascending within an expert (Megatron's permuted order).
    order = routing_map.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[: num_tokens * topk]
    rows = (order % max(num_tokens, 1)).to(torch.int32)
    # Token t's rows, ascending: a stable sort of the rows by token.
    token_rows = rows.argsort(stable=True).to(torch.int32).view(num_tokens, topk)
    permuted_probs = None if probs is None else probs.T.contiguous().reshape(-1).index_select(0, order)
    return Permutation(rows, token_rows), routing_map.sum(0), permuted_probs


def _check_row_operand(t, name: str, op: str) -> None:
    """The rules of a gather's input and a combine's input, on every backend and before any work (the GPU's rules:
    csrc/binding/combine_rows.cpp): BF16 `[rows, H]` with H % 8 == 0, since the combine (gather_rows' backward,
    combine_rows' forward) adds BF16 rows read as 16-byte vectors and rounds its sum to BF16. An FP32 input would get
    a gradient rounded to BF16 (on the CPU, silently) or fail in backward (on the GPU)."""
    check_tensor(t, name, (torch.bfloat16,), dim=2, contiguous=False)
    if t.shape[1] % 8:
        raise ValueError(f"the last dim of {name} must be a multiple of 8 (the combine reads 16-byte rows; {op}), got "
                         f"{t.shape[1]}")


def _check_combine_args(y: torch.Tensor, token_rows: torch.Tensor) -> None:
    _check_row_operand(y, "y", "combine_rows")
    check_tensor(y, "y", contiguous=True)
    if y.numel():
        check_aligned16(y, "y", "the combine kernel reads its rows as 16-byte vectors")
    check_tensor(token_rows, "token_rows", (torch.int32,), dim=2)
    if token_rows.device != y.device:
        raise ValueError(f"token_rows must be on y's device {y.device}, got {token_rows.device}")
    k = token_rows.shape[1]
    if not 1 <= k <= COMBINE_MAX_ROWS_PER_TOKEN:
        raise ValueError(f"token_rows must have 1..{COMBINE_MAX_ROWS_PER_TOKEN} rows per token, got {k}")
    if token_rows.shape[0] and not y.shape[0]:
        raise ValueError("token_rows name rows of y, which has none")


def run_combine_rows(y: torch.Tensor, token_rows: torch.Tensor, backend: str) -> torch.Tensor:
    """`combine_rows` without its argument checks (callers that checked the plan once)."""
    return ops.kernel("combine_rows", backend == "reference")(y, token_rows)


def check_permutation(permutation, num_rows: Optional[int], x: Optional[torch.Tensor], name: str = "permutation",
                      device: Optional[torch.device] = None) -> Permutation:
    """The checks of a `Permutation` against its use: permuted rows (`num_rows` of them, if not None) of the tokens
    x `[T, H]` (if not None; else of tokens on `device`)."""
    if not isinstance(permutation, Permutation):
        raise TypeError(f"{name} must be a megatron_tma.permutation.Permutation, got {type(permutation).__name__}")
    check_tensor(permutation.rows, f"{name}.rows", (torch.int32,), dim=1)
    check_tensor(permutation.token_rows, f"{name}.token_rows", (torch.int32,), dim=2)
    device = x.device if x is not None else device
    for t in permutation:
        if device is not None and t.device != device:
            raise ValueError(f"{name} must be on the tokens' device {device}, got {t.device}")
    t, k = permutation.token_rows.shape
    tokens = t if x is None else x.shape[0]
    if t != tokens or t * k != permutation.rows.shape[0] or num_rows not in (None, permutation.rows.shape[0]):
        raise ValueError(f"{name} does not fit: {tokens} tokens and {num_rows} permuted rows, but it has "
                         f"token_rows {list(permutation.token_rows.shape)} and {permutation.rows.shape[0]} rows")
    if not 1 <= k <= COMBINE_MAX_ROWS_PER_TOKEN:
        raise ValueError(f"{name} must have 1..{COMBINE_MAX_ROWS_PER_TOKEN} rows per token, got {k}")
    # The values, where they are on the host (free), or under the debug checks (a host sync): the CUDA kernels clamp
    # an index out of range and would read a wrong row, and rows that disagree with token_rows give an input gradient
    # that is not the forward's. Device tensors are otherwise never read (no sync on the hot path), and nothing is
    # read in code that torch.compile traces (a host read there would break the graph; on the CPU an index out of
    # range still fails in the reference's index_select when the graph runs).
    if (permutation.rows.device.type == "cpu" or debug_checks_enabled()) and not torch.compiler.is_compiling():
        check_permutation_values(permutation, name)
    return permutation


def check_permutation_values(permutation: Permutation, name: str = "permutation") -> None:
    """The values of a `Permutation` whose shapes passed `check_permutation`: every `rows` entry a token in [0, T),
    every `token_rows` entry a permuted row in [0, T k), each row named once, and `rows[token_rows[t, j]] == t`.
    ValueError naming `rows` / `token_rows`, the entry and the range. READS THEM ON THE HOST (a sync for device
    tensors)."""
    rows = permutation.rows.detach().cpu().long()
    token_rows = permutation.token_rows.detach().cpu().long()
    t, k = token_rows.shape
    n = rows.numel()
    bad = ((rows < 0) | (rows >= t)).nonzero()
    if bad.numel():
        i = bad[0, 0].item()
        raise ValueError(f"{name}.rows must hold token indices in [0, {t}) (T = {t} tokens), got rows[{i}]="
                         f"{rows[i].item()}")
    flat = token_rows.reshape(-1)
    bad = ((flat < 0) | (flat >= n)).nonzero()
    if bad.numel():
        i = bad[0, 0].item()
        raise ValueError(f"{name}.token_rows must hold permuted-row indices in [0, {n}) (T k = {n} rows), got "
                         f"token_rows[{i // k}, {i % k}]={flat[i].item()}")
    owner = rows[flat]  # the token each named row comes from
    bad = (owner != torch.arange(t).repeat_interleave(k)).nonzero()
    if bad.numel():
        i = bad[0, 0].item()
        raise ValueError(f"{name}.rows and {name}.token_rows disagree: token_rows[{i // k}, {i % k}]={flat[i].item()} "
                         f"names a row of token {i // k}, but rows[{flat[i].item()}]={owner[i].item()}")
    counts = torch.bincount(flat, minlength=n)
    bad = (counts != 1).nonzero()
    if bad.numel():
        r = bad[0, 0].item()
        raise ValueError(f"{name}.token_rows must name each of the {n} permuted rows in [0, {n}) once, got row {r} "
                         f"{counts[r].item()} times")


# The gather and the combine are each other's adjoints, and each backward is the other Function itself: so gradients
# through them are differentiable again (create_graph=True, gradient penalties), on the CUDA kernels too, with the
# same bits as before (the same ops run).
class _GatherRows(torch.autograd.Function):
    """x[rows]; backward: the rows' gradients combined per token (the same sum as `combine_rows`)."""

    @staticmethod
    def forward(ctx, x, rows, token_rows, backend):
        ctx.save_for_backward(rows, token_rows)
        ctx.backend = backend
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        rows, token_rows = ctx.saved_tensors
        return _CombineRows.apply(grad, rows, token_rows, ctx.backend), None, None, None


class _CombineRows(torch.autograd.Function):
    """combine_rows(y); backward: the gather grad[rows]."""

    @staticmethod
    def forward(ctx, y, rows, token_rows, backend):
        ctx.save_for_backward(rows, token_rows)
        ctx.backend = backend
        y = y.contiguous()
        if misalignment16(y):  # (a gradient autograd hands gather_rows' backward may be a view at any offset)
            y = y.clone()
        return run_combine_rows(y, token_rows, backend)

    @staticmethod
    def backward(ctx, grad):
        rows, token_rows = ctx.saved_tensors
        return _GatherRows.apply(grad, rows, token_rows, ctx.backend), None, None, None


def gather_rows(x: torch.Tensor, permutation: Permutation, *, backend: str = "auto") -> torch.Tensor:
    """The permuted rows `x[permutation.rows]` (x bf16 `[T, H]`, H % 8 == 0; returns bf16 `[T k, H]`),
    differentiable: the gradient of x is the rows' gradients combined per token (`combine_rows`' sum)."""
    _ext.check_backend(backend)
    _check_row_operand(x, "x", "gather_rows' backward")
    check_permutation(permutation, None, x)
    _ext.check_backend(backend, x.device)
    return _GatherRows.apply(x, permutation.rows, permutation.token_rows, backend)


def combine_rows(y: torch.Tensor, permutation: Permutation, *, backend: str = "auto") -> torch.Tensor:
    """The tokens `[T, H]` from their permuted rows y (bf16 `[T k, H]`, contiguous, 16-byte aligned, H % 8 == 0):
    each token's k rows added in FP32 in ascending row order, rounded once (module docstring). Differentiable: y's
    gradient is the gather of the tokens' gradient."""
    _ext.check_backend(backend)
    check_tensor(y, "y", contiguous=False)  # (a tensor before its device is read)
    _check_combine_args(y, check_permutation(permutation, None, None, device=y.device).token_rows)
    if y.shape[0] != permutation.rows.shape[0]:
        raise ValueError(f"y must have the permutation's {permutation.rows.shape[0]} rows, got {y.shape[0]}")
    _ext.check_backend(backend, y.device)
    return _CombineRows.apply(y, permutation.rows, permutation.token_rows, backend)
