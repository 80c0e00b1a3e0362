"""Weight gradients deferred over micro-batches: one K-grouped GEMM per step instead of one per micro-batch.

With gradient accumulation each micro-batch's weight-gradient GEMM reads and writes the FP32 `main_grad` of every
expert weight (8 bytes per weight per micro-batch: on Qwen3-30B-A3B's layer, 4.8 GB a micro-batch, a fifth of the
experts' GPU time at 4 micro-batches). Deferring keeps what each backward would have multiplied -- the FP8
token-column operands of dY and X (`quantize_grouped_128x1`'s, ~1 byte per routed token per feature) -- and at
`flush()` lays all of them out as one operand pair in which expert g's columns are those of micro-batch 1, then 2, ...
(each micro-batch's 128-token blocks whole, their zero columns included), so that one K-grouped GEMM adds
dW_g = sum over micro-batches of dY^T X into `main_grad` once.

The layout is a permutation of the operands' bytes (columns, and the scales' block rows), computed on the device
from the group sizes: no host read, no sync. A zero column adds an exact 0, so each expert's sum is over its own
tokens; the kernel's FP32 chain of 128-token blocks runs on across micro-batches instead of each micro-batch's sum
being added to `main_grad` on its own, so the bits differ from the undeferred path's (by FP32 rounding), and the
padded twin, deferred the same way, gives the same bits as the unpadded layer.
"""
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .groups import Groups, group_sizes

__all__ = ["PendingWgrad", "WgradDeferral", "combine_wgrad_operands"]

BLOCK = 128


class PendingWgrad(NamedTuple):
    """One backward's weight-gradient operands, as `linear_backward` would have handed them to the GEMM."""

    dyt: torch.Tensor  # e4m3 [N, P]
    dyt_s: torch.Tensor  # FP32 [MB, N]
    xt: torch.Tensor  # e4m3 [K, P]
    xt_s: torch.Tensor  # FP32 [MB, K]
    groups: Groups


def _exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


def _destinations(units: torch.Tensor, widths: Sequence[int]) -> List[torch.Tensor]:
    """Where each source's units (columns, or block rows) go in the combined layout.

    units: int64 [S, G], source s's units of group g, in group order from
    unit 0 of the source; widths[s]: the source's total units (its buffer's extent), the rest of it a zero tail.
    The combined layout holds group 0's units of source 0, 1, ..., then group 1's, ..., then every source's tail in
    source order: a bijection onto sum(widths) units. Returns one int64 index per source, tensor ops only. (Units here
    are 128-token blocks: of columns for the FP8 operands, of scale rows for their scales.)"""
    num_sources, g = units.shape
    per_group = units.sum(0)  # [G]
    group_start = _exclusive_cumsum(per_group, 0)  # [G]
    seg_start = group_start.unsqueeze(0) + _exclusive_cumsum(units, 0)  # [S, G]: source s's segment of group g
    used = units.sum(1)  # [S]
    # widths - used, the widths added as Python scalars: torch.tensor(widths, device=...) would be a pageable host copy,
    # which waits for the stream (a sync per flush: measured, the flush's host time then grew to the GPU's)
    tails = torch.stack([widths[s] - used[s] for s in range(num_sources)])
    tail_start = per_group.sum() + _exclusive_cumsum(tails, 0)  # [S]
    out = []
    for s in range(num_sources):
        # the source's units, each labelled with its group (G = the tail), then its offset inside the segment
        repeats = torch.cat([units[s], tails[s:s + 1]])
        label = torch.repeat_interleave(torch.arange(g + 1, device=units.device), repeats, output_size=widths[s])
        first = _exclusive_cumsum(repeats, 0)  # [G+1]: the segment's first unit in the source
        start = torch.cat([seg_start[s], tail_start[s:s + 1]])  # [G+1]: its first unit in the combined layout
        unit = torch.arange(widths[s], device=units.device)
        out.append(start[label] + (unit - first[label]))
    return out


def combine_wgrad_operands(pending: List[PendingWgrad]) -> PendingWgrad:
    """One operand pair for the K-grouped GEMM from several backwards' (module docstring): expert g's 128-token
    blocks of every source in source order, the sources' zero tails after all of them, the scales' block rows
    permuted alike; the groups are sizes [G], each expert's blocks' columns (multiples of 128). Empties `pending`,
    dropping each source once it is copied, so that the flush holds the combined pair and at most one source's."""
    g = pending[0].groups.num_groups
    sizes = torch.stack([group_sizes(p.groups.tensor, p.groups.is_offsets).to(torch.int64).clamp(min=0)
                         for p in pending])  # [S, G]
    blocks = (sizes + BLOCK - 1) // BLOCK  # [S, G]
    # The columns move as whole 128-column blocks (each source's P is a multiple of 128, wgrad_pitch): an index per
    # block, each copied as 128 contiguous bytes of every row, not an index per byte column
    col_dest = _destinations(blocks, [p.dyt.shape[1] // BLOCK for p in pending])
    row_dest = _destinations(blocks, [p.dyt_s.shape[0] for p in pending])

    def empty(field: int, dim: int) -> torch.Tensor:
        ref = pending[0][field]
        shape = list(ref.shape)
        shape[dim] = sum(p[field].shape[dim] for p in pending)
        return torch.empty(shape, dtype=torch.uint8 if ref.dtype.itemsize == 1 else ref.dtype, device=ref.device)

    fp8 = pending[0].dyt.dtype
    out = [empty(0, 1), empty(1, 0), empty(2, 1), empty(3, 0)]  # dyt, dyt_s, xt, xt_s
    for s in range(len(pending)):
        source, pending[s] = pending[s], None  # the list's reference goes with the copy: freed once copied
        for i, (dim, dest) in enumerate(((1, col_dest[s]), (0, row_dest[s]), (1, col_dest[s]), (0, row_dest[s]))):
            t = source[i]
            if dim == 1:  # [rows, P] bytes as [rows, P / 128, 128]: blocks of columns
                t = t.view(torch.uint8).contiguous()
                out[i].view(t.shape[0], -1, BLOCK).index_copy_(1, dest, t.view(t.shape[0], -1, BLOCK))
            else:
                out[i].index_copy_(dim, dest, t)
        del source, t
    pending.clear()
    return PendingWgrad(out[0].view(fp8), out[1], out[2].view(fp8), out[3],
                        Groups((blocks * BLOCK).sum(0), g, False, None))


class WgradDeferral:
    """A grouped linear's pending weight gradients: `add` keeps one backward's operands, `take` hands back what one
    GEMM computes (the operands combined when there are several) and forgets them. `is_last` (optional): asked after
    each backward's `add`; True makes that backward compute every pending gradient itself (Megatron's last
    micro-batch, whose DDP hooks may start the gradient reduction as soon as the weight's gradient is handed over)."""

    def __init__(self, is_last: Optional[Callable[[], bool]] = None) -> None:
        self.pending: List[PendingWgrad] = []
        self.is_last = is_last
        self.needs: Tuple[bool, ...] = ()  # which weights want a gradient (the backwards' needs_input_grad)

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, item: PendingWgrad, needs: Tuple[bool, ...]) -> None:
        if self.pending:
            ref = self.pending[0]
            if (item.dyt.shape[0], item.xt.shape[0], item.groups.num_groups, item.dyt.device, needs) != (
                    ref.dyt.shape[0], ref.xt.shape[0], ref.groups.num_groups, ref.dyt.device, self.needs):
                raise ValueError("deferred weight gradients of one linear must share N, K, G, the device and which "
                                 "weights want a gradient")
        self.pending.append(item)
        self.needs = needs

    def due(self) -> bool:
        return self.is_last is not None and bool(self.is_last())

    def take(self) -> Tuple[PendingWgrad, int]:
        """(the operands of one GEMM, how many backwards they hold); empties the deferral."""
        if not self.pending:
            raise RuntimeError("no weight gradient is pending: flush after the backward passes that deferred them")
        pending, self.pending = self.pending, []
        count = len(pending)
        return (pending[0] if count == 1 else combine_wgrad_operands(pending)), count
