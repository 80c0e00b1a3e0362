"""Group bookkeeping: the one description of how the rows of an activation matrix split into G groups.

A grouping is a single int32/int64 tensor on the data's device, either the sizes ``[G]`` or the offsets
``[G+1]`` (``offsets[0] == 0``, ``offsets[G] == M_total``). The kernels read it on the device and build
offsets per CTA (``csrc/include/megatron_tma/common/groups.cuh``), so nothing here reads a device
tensor on the host:

* ``check_groups`` checks dtype/rank/length/device from metadata only and returns a ``Groups``: the
  tensor with what the check found (G, sizes or offsets, the rows it was checked against). Every public
  entry calls it; a ``Groups`` handed to another entry (the expert MLP hands one to every quantizer and GEMM
  of its step, forward and backward) is not checked again, only matched against that call's G, rows and
  device. Values are validated for free when the tensor lives on the CPU; a device tensor is validated only
  with debug checks on
  (``set_debug_checks(True)`` or ``MEGATRON_TMA_DEBUG_CHECKS=1``), because that costs a host sync and
  breaks CUDA-graph capture. Without them, malformed device groups (negative sizes, sizes that do not
  sum to M_total, decreasing offsets) are clamped by the kernels -- negative sizes count as 0 and
  totals are capped at M_total -- so memory stays safe, but the results are undefined.
* ``sizes_to_offsets``, ``offsets_to_sizes``, ``padded_sizes``, ``token_block_counts``,
  ``token_block_offsets``, ``aligned_token_offsets`` are tensor ops on the same device (no sync, capturable;
  they also work on ``meta`` tensors, which is how the tests prove they never read values). ``max_tiles``,
  ``wgrad_pitch`` and ``padded_row_count_upper_bound`` are host bounds from M_total and G alone.
* The functions that do read values say so in their names or docstrings: ``check_groups_values``,
  ``check_wgrad_columns``, ``host_group_sizes`` (oracle and tests), ``tile_map`` (reference tile list for
  tests) and ``make_group_sizes`` (benchmark/test generator, CPU only).
"""
import os
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from ._validate import check_int

GROUP_DTYPES = (torch.int32, torch.int64)
DISTRIBUTIONS = ("paper", "skewed", "balanced", "one_group", "with_empty")
DEBUG_ENV = "MEGATRON_TMA_DEBUG_CHECKS"

def _env_debug_checks() -> bool:
    """$MEGATRON_TMA_DEBUG_CHECKS: "1" on, "0" / empty / unset off. Anything else is refused: a typo ("2", "true",
    "on") must not silently leave the checks off while the user believes them on."""
    value = os.environ.get(DEBUG_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{DEBUG_ENV} must be 1 (debug checks on) or 0 / empty / unset (off), got {value!r}")
    return value == "1"


# Read once (every GEMM call asks; host time per call matters); set_debug_checks(None) re-reads it.
_debug_checks: bool = _env_debug_checks()


def set_debug_checks(enabled: Optional[bool]) -> None:
    """Turn host-side validation of device group tensors on/off (None: follow $MEGATRON_TMA_DEBUG_CHECKS).

    With it on, every call that takes groups copies them to the host (a device sync) and raises on
    malformed values; do not leave it on in training or under CUDA-graph capture.
    """
    global _debug_checks
    _debug_checks = _env_debug_checks() if enabled is None else bool(enabled)


def debug_checks_enabled() -> bool:
    return _debug_checks


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" (no index) means the current device; data tensors always carry an index.
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_group_tensor(groups, name: str) -> None:
    """Type, dtype and rank of a group tensor (metadata only)."""
    if not isinstance(groups, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of group sizes [G] or offsets [G+1] (int32 or int64), "
            f"got {type(groups).__name__}"
        )
    if groups.dtype not in GROUP_DTYPES:
        raise TypeError(f"{name} must have dtype int32 or int64, got {str(groups.dtype).replace('torch.', '')}")
    if groups.dim() != 1:
        raise ValueError(f"{name} must be 1-D (sizes [G] or offsets [G+1]), got shape {tuple(groups.shape)}")


def _holds_offsets(groups: torch.Tensor, num_groups: Optional[int], name: str) -> bool:
    """Whether a (checked) group tensor holds offsets, from its length and num_groups (metadata only)."""
    length = groups.numel()
    if num_groups is None:
        if length == 0:
            raise ValueError(f"{name} is empty: expected G >= 1 group sizes")
        return False
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if length == num_groups:
        return False
    if length == num_groups + 1:
        return True
    raise ValueError(f"{name} has {length} entries: expected G sizes or G+1 offsets with G={num_groups}")


def groups_name(groups, num_groups: int, source: str, name: str = "groups") -> str:
    """`name` for the errors of a group tensor whose G another operand fixed (`source`, e.g. "out"): a tensor of G+1
    entries is then read as offsets, so a size too many (sizes for another G) fails as "offsets must start at 0"
    unless the error says why they were read as offsets. Metadata only."""
    if type(groups) is Groups or not isinstance(groups, torch.Tensor) or groups.dim() != 1:
        return name
    if groups.numel() == num_groups + 1:
        return f"{name} ({groups.numel()} entries, read as offsets [G+1] since {source} holds G={num_groups} groups)"
    return f"{name} ({source} holds G={num_groups} groups)"


class Groups(NamedTuple):
    """A group description that passed `check_groups`, typed: what every quantizer and GEMM takes in place of the raw
    tensor without checking it again. Build it with `check_groups`; constructing one directly vouches for it."""

    tensor: torch.Tensor  # contiguous int32/int64 sizes [G] or offsets [G+1] on the data's device
    num_groups: int  # G
    is_offsets: bool
    m_total: Optional[int]  # the rows its values were checked against (None: not known at the check)


def check_groups(
    groups,
    num_groups: Optional[int] = None,
    m_total: Optional[int] = None,
    *,
    device: Optional[Union[torch.device, str]] = None,
    name: str = "groups",
) -> Groups:
    """Check a group description once; returns it as a `Groups`.

    ``groups``: an int32/int64 tensor of sizes ``[G]`` or offsets ``[G+1]``, or a `Groups` from an earlier check.
    ``num_groups`` disambiguates: a tensor of G entries holds sizes, G+1 entries offsets. Without it the tensor is
    taken as sizes (so offsets need ``num_groups``). ``device`` is the data's device, which the groups must share.
    ``m_total`` (the data's row count) is what the value checks hold the sizes against. The dtype is kept (the
    kernels read int32 and int64 alike); no copy unless the tensor is strided.
    A `Groups` is matched against this call (G, rows, device: a few integer compares, no tensor op); its values are
    checked only if it was checked without rows and this call knows them.
    """
    if num_groups is not None or m_total is not None:
        _check_counts(num_groups, m_total)
    if type(groups) is Groups:
        t = groups.tensor  # its own metadata first (integer compares): a hand-built one may not fit itself
        if (t.dtype not in GROUP_DTYPES or t.dim() != 1 or not t.is_contiguous()
                or t.numel() != groups.num_groups + groups.is_offsets or groups.num_groups < 1):
            raise ValueError(f"{name}: a Groups whose tensor does not match it (dtype {t.dtype}, shape "
                             f"{tuple(t.shape)}, G={groups.num_groups}, is_offsets={groups.is_offsets}); build it "
                             "with check_groups")
        if num_groups is not None and groups.num_groups != num_groups:
            raise ValueError(f"{name} describe {groups.num_groups} groups, but this call has G={num_groups}")
        if device is not None and not _same_device(groups.tensor.device, torch.device(device)):
            raise ValueError(f"{name} must be on the data's device {torch.device(device)}, got {groups.tensor.device}")
        if m_total is None or groups.m_total == m_total:
            return groups
        if groups.m_total is not None:
            raise ValueError(f"{name} were checked for M_total={groups.m_total} rows, but this call's data has "
                             f"{m_total}")
        if _checks_values(t):
            check_groups_values(t, groups.is_offsets, m_total, name=name)
        return groups._replace(m_total=m_total)
    _check_group_tensor(groups, name)
    if device is not None and not _same_device(groups.device, torch.device(device)):
        raise ValueError(f"{name} must be on the data's device {torch.device(device)}, got {groups.device}")
    length = groups.numel()
    if num_groups is not None and num_groups >= 1 and (length == num_groups or length == num_groups + 1):
        is_offsets = length == num_groups + 1
    else:  # no G (sizes), or an error to word
        is_offsets = _holds_offsets(groups, num_groups, name)
    if not groups.is_contiguous():
        groups = groups.contiguous()
    if _checks_values(groups):
        check_groups_values(groups, is_offsets, m_total, name=name)
    return Groups(groups, length - is_offsets, is_offsets, m_total)


def _checks_values(groups: torch.Tensor) -> bool:
    """Whether `check_groups` reads the values: on the CPU (free) or with debug checks on, but never in code that
    torch.compile traces (a host read there would break the graph). A compiled graph still has them checked where
    they are on the CPU: the ops' reference kernels check what they read when the graph runs (megatron_tma.ops)."""
    return (_debug_checks or groups.device.type == "cpu") and not torch.compiler.is_compiling()


def _check_counts(num_groups, m_total) -> None:
    """num_groups and m_total are ints (>= 1, >= 0) when given: a tensor or a float there is the caller's error."""
    if num_groups is not None:
        check_int(num_groups, "num_groups", 1)
    if m_total is not None:
        check_int(m_total, "m_total", 0)


def _quote(pairs: List[Tuple[int, int]], what: str, limit: int = 4) -> str:
    text = ", ".join(f"{what}[{i}]={v}" for i, v in pairs[:limit])
    return text + (f" (and {len(pairs) - limit} more)" if len(pairs) > limit else "")


def check_groups_values(groups: torch.Tensor, is_offsets: bool, m_total: Optional[int] = None, *, name="groups"):
    """Validate the values of a group tensor. READS IT ON THE HOST (a sync for device tensors)."""
    vals = groups.detach().cpu().tolist()
    if is_offsets:
        if vals[0] != 0:
            raise ValueError(f"{name}: offsets must start at 0, got offsets[0]={vals[0]}")
        bad = [(i, vals[i], vals[i + 1]) for i in range(len(vals) - 1) if vals[i + 1] < vals[i]]
        if bad:
            i, a, b = bad[0]
            raise ValueError(
                f"{name}: offsets must be non-decreasing, got offsets[{i}]={a} > offsets[{i + 1}]={b}"
                + (f" ({len(bad)} decreasing steps in all)" if len(bad) > 1 else "")
            )
        if m_total is not None and vals[-1] != m_total:
            raise ValueError(
                f"{name}: offsets must end at M_total={m_total} (rows of the data), "
                f"got offsets[{len(vals) - 1}]={vals[-1]}"
            )
    else:
        neg = [(i, v) for i, v in enumerate(vals) if v < 0]
        if neg:
            raise ValueError(f"{name}: group sizes must be >= 0, got negative {_quote(neg, 'sizes')}")
        if m_total is not None and sum(vals) != m_total:
            raise ValueError(
                f"{name}: group sizes sum to {sum(vals)}, but the data has M_total={m_total} rows"
            )


def host_group_sizes(
    groups,
    num_groups: Optional[int] = None,
    m_total: Optional[int] = None,
    *,
    device: Optional[Union[torch.device, str]] = None,
    name: str = "groups",
) -> List[int]:
    """Validated group sizes as a Python list (``groups`` a tensor or a `Groups`). READS ON THE HOST: for the
    reference and tests only."""
    g = check_groups(groups, num_groups, m_total, device=device, name=name)
    if g.tensor.device.type != "cpu" and not debug_checks_enabled():  # the check skipped the values
        check_groups_values(g.tensor, g.is_offsets, m_total, name=name)
    vals = g.tensor.cpu().tolist()
    return [vals[i + 1] - vals[i] for i in range(len(vals) - 1)] if g.is_offsets else vals


def sizes_to_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """int32 offsets [G+1] (leading 0) on the sizes' device; no host read."""
    out = torch.zeros(sizes.numel() + 1, dtype=torch.int32, device=sizes.device)
    torch.cumsum(sizes, 0, dtype=torch.int32, out=out[1:])
    return out


def offsets_to_sizes(offsets: torch.Tensor) -> torch.Tensor:
    """Sizes [G] from offsets [G+1], same dtype and device; no host read."""
    return offsets[1:] - offsets[:-1]


def group_sizes(groups: torch.Tensor, is_offsets: bool) -> torch.Tensor:
    """Sizes [G] from a normalized group tensor (either form); no host read."""
    return offsets_to_sizes(groups) if is_offsets else groups


def padded_sizes(sizes: torch.Tensor, align: int) -> torch.Tensor:
    """Each size rounded up to a multiple of ``align`` (the padded layout's groups); no host read."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return (sizes + (align - 1)) // align * align


def max_tiles(m_total: int, num_groups: int, block: int) -> int:
    """Upper bound of sum_g ceil(M_g / block) over all groupings of m_total rows into num_groups groups.

    Each group adds at most one partial block: sum_g ceil(M_g/b) <= sum_g (M_g // b + 1) <= M//b + G.
    Buffers sized by the group sizes (token-block scales, tile lists) are allocated at this bound.
    """
    return m_total // block + num_groups


def token_block_counts(sizes: torch.Tensor, block: int = 128) -> torch.Tensor:
    """ceil(M_g / block) per group (negative sizes count as 0, as in the kernels); no host read."""
    return (sizes.clamp(min=0) + (block - 1)) // block


def token_block_offsets(sizes: torch.Tensor, block: int = 128) -> torch.Tensor:
    """B_g = sum_{h<g} ceil(M_h/block) as int32 [G+1]: group g's first row in the wgrad scale tensor."""
    return sizes_to_offsets(token_block_counts(sizes, block))


def padded_row_count_upper_bound(m_total, num_groups, align: int = 128):
    """Rows of the padded buffers: the exact maximum of ``sum_g round_up(M_g, align)`` over all group sizes.

    At most ``n = min(num_groups, m_total)`` groups are non-empty and each wastes at most ``align - 1`` rows,
    so the maximum is ``align * ((m_total - n) // align + n)`` (reached by n - 1 one-row groups and one group
    with the rest). It is at most ``round_up(m_total, align) + align * num_groups`` and is 0 for m_total == 0.
    The op's CUDA kernel (``padded_rows_upper_bound`` in host/pad_gather.h), its reference and its fake kernel
    allocate with this formula (megatron_tma.ops).
    """
    if m_total < 0:
        raise ValueError(f"m_total must be >= 0, got {m_total}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    nonempty = torch.sym_min(num_groups, m_total)
    return align * ((m_total - nonempty) // align + nonempty)


# The wgrad operands' 128-token group starts (docs/design.md §4, docs/layouts.md): group g's tokens sit at columns
# [a_g, a_g + M_g) of qt [K, P], a_g = sum_{h<g} round_up(M_h, 128); P is allocated at its upper bound. With P a
# multiple of 128 too, every 128-token block of every group is one whole 128-byte line of each qt row, and a group's
# partial last block can be read whole: the columns after it are zeros, written by the quantizer.
WGRAD_ALIGN = 128


def wgrad_pitch(m_total: int, num_groups: int) -> int:
    """P, the token columns of the wgrad operands: ``round_up(m_total, 128) + 128 * num_groups``.

    The upper bound of ``a_G = sum_g round_up(M_g, 128)`` over all groupings of m_total rows into num_groups groups
    (``sum_g ceil(M_g/128) <= m_total // 128 + G``); a multiple of 128, so that every row of ``[K, P]`` starts on a
    128-byte line; from host ints only, so the quantizers allocate ``[K, P]`` without reading the sizes.
    """
    if m_total < 0:
        raise ValueError(f"m_total must be >= 0, got {m_total}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    return (m_total + WGRAD_ALIGN - 1) // WGRAD_ALIGN * WGRAD_ALIGN + WGRAD_ALIGN * num_groups


def aligned_token_offsets(groups: torch.Tensor, num_groups: Optional[int] = None) -> torch.Tensor:
    """a_g = sum_{h<g} round_up(M_h, 128) as int64 [G+1] (``a_G`` last): each group's first column in the wgrad
    operands. ``groups``: sizes [G], or offsets [G+1] with ``num_groups`` = G (as ``check_groups``), or a `Groups`;
    negative sizes count as 0, as in the kernels. A tensor op on the groups' device: no host read, no sync."""
    if type(groups) is not Groups:  # metadata only (the values are the kernels' business)
        _check_group_tensor(groups, "groups")
        groups = Groups(groups, 0, _holds_offsets(groups, num_groups, "groups"), None)
    sizes = group_sizes(groups.tensor, groups.is_offsets)
    out = torch.zeros(sizes.numel() + 1, dtype=torch.int64, device=sizes.device)
    torch.cumsum(padded_sizes(sizes.to(torch.int64).clamp(min=0), WGRAD_ALIGN), 0, out=out[1:])
    return out


def check_wgrad_columns(groups: torch.Tensor, is_offsets: bool, pitch_cols: int, scale_rows: int,
                        *, name: str = "groups") -> None:
    """The group sizes fit the wgrad operands: ``sum_g round_up(M_g, 128) <= P`` (tokens inside qt's columns) and
    ``sum_g ceil(M_g/128) <= MB`` (blocks inside the scale rows). READS THE GROUPS ON THE HOST (a sync for device
    tensors): for the reference, CPU tensors and debug checks. Values are assumed checked (non-negative sizes)."""
    vals = groups.detach().cpu().tolist()
    sizes = [vals[i + 1] - vals[i] for i in range(len(vals) - 1)] if is_offsets else vals
    cols = sum(-(-m // WGRAD_ALIGN) * WGRAD_ALIGN for m in sizes)
    hint = "" if is_offsets else " (offsets [G+1] need num_groups=G or out: without them the tensor holds sizes)"
    if cols > pitch_cols:
        raise ValueError(
            f"{name}: the groups need sum_g round_up(M_g, {WGRAD_ALIGN}) = {cols} token columns, but the wgrad operands have "
            f"P = {pitch_cols}{hint}"
        )
    blocks = sum(-(-m // 128) for m in sizes)
    if blocks > scale_rows:
        raise ValueError(
            f"{name}: the groups have sum_g ceil(M_g/128) = {blocks} token blocks, but the token-block scales have "
            f"{scale_rows} rows{hint}"
        )


def check_wgrad_tokens(groups: torch.Tensor, is_offsets: bool, pitch_cols: int, scale_rows: int,
                       *, name: str = "groups") -> None:
    """The group sizes cover exactly the tokens the wgrad operands were quantized from, as the M-grouped GEMM's sizes
    must sum to its rows: M_total = sum_g M_g gives the operands' P (``wgrad_pitch``) and MB (``max_tiles`` of 128).
    Sizes that cover fewer (or more) tokens raise instead of giving a partial dW. The operands fix M_total up to
    their rounding, so this is the M-grouped rule wherever P and MB can tell. READS THE GROUPS ON THE HOST: for the
    reference, CPU tensors and debug checks. Values are assumed checked (non-negative sizes)."""
    vals = groups.detach().cpu().tolist()
    g = len(vals) - 1 if is_offsets else len(vals)
    total = vals[-1] - vals[0] if is_offsets else sum(vals)
    want = (wgrad_pitch(total, g), max_tiles(total, g, 128))
    if (pitch_cols, scale_rows) != want:
        raise ValueError(
            f"{name}: group sizes sum to M_total={total}, but the wgrad operands (P={pitch_cols} token columns, "
            f"MB={scale_rows} scale rows) were not quantized from {total} tokens in {g} groups (that gives P={want[0]}, "
            f"MB={want[1]}): the sizes must cover every token of the operands, as they must cover every row of "
            f"m_grouped_fp8_gemm's a"
        )


def tile_map(sizes, block_m: int) -> torch.Tensor:
    """Reference tile list for tests. READS THE SIZES ON THE HOST.

    Returns a CPU int64 tensor [T, 3] of (group, first row, rows) for every M tile of every group in
    group order, tiles starting at the group's first row (no tile straddles two groups); empty groups
    own no tile. T <= max_tiles(M_total, G, block_m).
    """
    vals = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    tiles, row = [], 0
    for g, m in enumerate(vals):
        for start in range(0, m, block_m):
            tiles.append((g, row + start, min(block_m, m - start)))
        row += m
    return torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3)


def make_group_sizes(m_total: int, num_groups: int, dist: str = "paper", seed: int = 0) -> torch.Tensor:
    """Deterministic group sizes for tests and benchmarks: a CPU int64 tensor [G] summing to m_total.

    dist:
      "paper"      the generator of arXiv:2508.16584: each size drawn uniformly from the integers
                   [0, 2*M/G], then rescaled (floor) to sum to M, the remainder going to the last group.
      "skewed"     Zipf-like: weights 1/rank over a seeded random ranking, floor(M * w / sum w), the
                   remainder to the rank-1 group (one group holds ~M/H_G tokens, the tail a few).
      "balanced"   M // G each, the first M % G groups one more (seed unused).
      "one_group"  all M tokens in one seeded group, all others empty.
      "with_empty" the first and last groups and a seeded random half of the others are empty (at
                   least one group stays non-empty); the non-empty ones share M like "paper".
                   G == 1 cannot have an empty group and gives [M]; G == 2 empties group 0.
    """
    if m_total < 0:
        raise ValueError(f"m_total must be >= 0, got {m_total}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown group-size distribution {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    gen = torch.Generator().manual_seed(seed)
    G = num_groups
    if dist == "paper":
        return _paper_sizes(m_total, G, gen)
    if dist == "balanced":
        base, extra = divmod(m_total, G)
        return torch.tensor([base + (g < extra) for g in range(G)], dtype=torch.int64)
    if dist == "one_group":
        sizes = torch.zeros(G, dtype=torch.int64)
        sizes[int(torch.randint(G, (1,), generator=gen))] = m_total
        return sizes
    if dist == "skewed":
        rank = torch.randperm(G, generator=gen) + 1
        weights = 1.0 / rank.double()
        sizes = torch.floor(m_total * weights / weights.sum()).long()
        sizes[rank == 1] += m_total - int(sizes.sum())
        return sizes
    # with_empty
    if G == 1:
        return torch.tensor([m_total], dtype=torch.int64)
    keep = torch.zeros(G, dtype=torch.bool)
    if G == 2:
        keep[1] = True
    else:
        inner = torch.rand(G - 2, generator=gen) < 0.5
        if not inner.any():
            inner[int(torch.randint(G - 2, (1,), generator=gen))] = True
        keep[1:-1] = inner
    sizes = torch.zeros(G, dtype=torch.int64)
    sizes[keep] = _paper_sizes(m_total, int(keep.sum()), gen)
    return sizes


def _paper_sizes(m_total: int, G: int, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 2 * m_total // G + 1, (G,), generator=gen, dtype=torch.int64)
    total = int(raw.sum())
    sizes = raw * m_total // total if total > 0 else torch.zeros(G, dtype=torch.int64)
    sizes[-1] += m_total - int(sizes.sum())
    return sizes
