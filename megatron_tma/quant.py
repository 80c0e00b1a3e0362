"""FP8 (e4m3) block quantizers: the numerics of docs/design.md §3 in the byte layouts of docs/layouts.md.

* ``quantize_1x128``: activations / output gradients for the M-grouped GEMMs, one scale per row per
  128 columns; ``s`` is an M-contiguous ``[M, ceil(K/128)]`` view.
* ``quantize_128x128``: weights, one scale per 128x128 block, plus the transposed copy (same bytes,
  transposed scales) that dgrad multiplies with.
* ``quantize_grouped_128x1``: wgrad operands, token-contiguous ``qt [K, P]`` (every group starting on a
  128-column boundary, zeros between groups and after the last) with one scale per column per 128-token
  block of each group (blocks start at a group's first row).
* ``quantize_1x128_and_grouped_128x1``: the first and the third from one read of x (the backward needs
  dY in both forms, the forward can keep X^T for wgrad): the same outputs, a third less memory traffic.

Each function checks its arguments and calls its op (``torch.ops.megatron_tma.quantize_*``, megatron_tma.ops)
once: the CUDA kernels (csrc/include/megatron_tma/kernels/quantize_*.cuh) on GPU tensors, the reference
(``megatron_tma.reference``) on the CPU; ``backend="cuda"`` insists on the kernels, ``"reference"`` runs the
oracle on any device. Both give the same bytes. The CUDA ops allocate their outputs themselves
(``torch.empty``; every byte, padding included, is written by the kernel), never synchronise and never read the
group tensor on the host, so they can be captured in a CUDA graph; their fake kernels let ``torch.compile`` trace
them.

Input rules (the same for both backends, so code that runs on the CPU runs on the GPU): a contiguous
bfloat16 or float16 tensor whose last dim (K) is a multiple of 16; for weights N as well. K and N need
not be multiples of 128 (edge blocks are partial), though the GEMMs ask for K % 128 == 0.
"""
from typing import Optional, Tuple

import torch

from . import _ext, ops
from ._validate import check_aligned16, check_tensor
from .groups import Groups, check_groups
from .limits import QUANTIZE_GROUPED_MAX_GROUPS

__all__ = [
    "quantize_1x128",
    "quantize_128x128",
    "quantize_128x128_from_master",
    "quantize_grouped_128x1",
    "quantize_1x128_and_grouped_128x1",
    "INPUT_DTYPES",
    "MAX_GROUPS",
]

INPUT_DTYPES = (torch.bfloat16, torch.float16)
MAX_GROUPS = QUANTIZE_GROUPED_MAX_GROUPS  # kQuantizeGroupedMaxGroups in csrc/include/megatron_tma/host/quantize.h


def _check_pow2(pow2) -> None:
    if not isinstance(pow2, bool):
        raise TypeError(f"pow2 must be a bool, got {type(pow2).__name__}")


def _check_aligned_input(x: torch.Tensor, name: str) -> None:
    """The quantizer ops' rule for their data input, on every backend: a 16-byte aligned start unless empty."""
    if x.numel():
        check_aligned16(x, name, "the kernels read rows as 16-byte vectors")


def _check_dim16(value: int, what: str, op: str) -> None:
    if value % 16 != 0:
        raise ValueError(
            f"{op}: {what} must be a multiple of 16, got {value} (the kernels move rows as 16-byte vectors)"
        )


def quantize_1x128(
    x: torch.Tensor, pow2: bool = False, *, backend: str = "auto"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations with one scale per row per 128 columns.

    x: bf16/fp16 ``[M, K]``, contiguous, K % 16 == 0. pow2: power-of-two (UE8M0-compatible) scales.
    Returns ``q`` e4m3 ``[M, K]`` and ``s`` FP32 ``[M, ceil(K/128)]`` with strides ``(1, M_pad)``:
    a view of storage ``[ceil(K/128), M_pad]``, ``M_pad = ceil(M/4)*4``, pad entries 1.0 (the layout the
    M-grouped GEMM's TMA reads).
    """
    check_tensor(x, "x", INPUT_DTYPES, dim=2)
    _check_dim16(x.shape[1], "K (the last dim of x)", "quantize_1x128")
    _check_pow2(pow2)
    _check_aligned_input(x, "x")
    _ext.check_backend(backend, x.device)
    return run_1x128(x, pow2, backend)


def run_1x128(x: torch.Tensor, pow2: bool, backend: str):
    """`quantize_1x128` without its argument rules, for callers whose x passed them already (the autograd Functions'
    entry checks); the op's precondition checks still guard the kernel."""
    return ops.kernel("quantize_1x128", backend == "reference")(x, pow2)


def quantize_128x128(w: torch.Tensor, pow2: bool = False, *, backend: str = "auto"):
    """Quantize weights with one scale per 128x128 block, and materialise the transposed copy.

    w: bf16/fp16 ``[G, N, K]`` (or ``[N, K]``), contiguous, N % 16 == 0 and K % 16 == 0.
    Returns ``(q, s, qt, st)``: q e4m3 ``[G, N, K]``, s FP32 ``[G, ceil(N/128), ceil(K/128)]``,
    qt = q transposed ``[G, K, N]`` (the same bytes) and st = s transposed, all contiguous, in one pass
    over w. A 2-D w gives the four without the G dim.
    """
    check_tensor(w, "w", INPUT_DTYPES)
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [N, K] or [G, N, K], got shape {tuple(w.shape)}")
    _check_dim16(w.shape[-2], "N (dim -2 of w)", "quantize_128x128")
    _check_dim16(w.shape[-1], "K (the last dim of w)", "quantize_128x128")
    _check_pow2(pow2)
    _check_aligned_input(w, "w")
    _ext.check_backend(backend, w.device)
    quantize = ops.kernel("quantize_128x128", backend == "reference")
    if w.dim() == 2:  # (the op takes [G, N, K])
        return tuple(t[0] for t in quantize(w.unsqueeze(0), pow2))
    q, s, qt, st = quantize(w, pow2)
    return q, s, qt, st


def quantize_128x128_from_master(master: torch.Tensor, pow2: bool = False, *, backend: str = "auto"):
    """`quantize_128x128` of FP32 master weights' BF16 rounding, without making it: the bytes of
    `quantize_128x128(master.bfloat16())` from one read of the masters (the FP8 weights an optimizer step writes
    straight from its FP32 masters, megatron_tma.released_weights). master: FP32 ``[G, N, K]``, contiguous, 16-byte
    aligned, N % 16 == 0 and K % 16 == 0. Returns ``(q, s, qt, st)`` as `quantize_128x128`."""
    check_tensor(master, "master", (torch.float32,), dim=3)
    _check_dim16(master.shape[1], "N (dim 1 of master)", "quantize_128x128_from_master")
    _check_dim16(master.shape[2], "K (dim 2 of master)", "quantize_128x128_from_master")
    _check_pow2(pow2)
    _check_aligned_input(master, "master")
    _ext.check_backend(backend, master.device)
    return ops.kernel("quantize_128x128_from_master", backend == "reference")(master, pow2)


def _check_grouped_args(x, groups, pow2, num_groups, op):
    check_tensor(x, "x", INPUT_DTYPES, dim=2)
    m, k = x.shape
    _check_dim16(k, "K (the last dim of x)", op)
    _check_pow2(pow2)
    _check_aligned_input(x, "x")
    groups = check_groups(groups, num_groups, m_total=m, device=x.device, name="groups")
    if groups.num_groups > MAX_GROUPS:
        raise ValueError(f"{op} supports at most {MAX_GROUPS} groups, got G={groups.num_groups}")
    return groups


def quantize_grouped_128x1(
    x: torch.Tensor,
    groups: torch.Tensor,
    pow2: bool = False,
    num_groups: Optional[int] = None,
    *,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize wgrad operands per column over 128-token blocks of each group, transposed.

    x: bf16/fp16 ``[M, K]``, contiguous, K % 16 == 0. groups: int32/int64 sizes ``[G]`` or offsets
    ``[G+1]`` on x's device (offsets need ``num_groups=G``; see ``groups.check_groups``) or a ``Groups``,
    never read on the host by the CUDA backend; 1 <= G <= 8192.
    Returns ``qt`` e4m3 ``[K, P]``, contiguous, ``P = round_up(M, 128) + 128 G`` (``groups.wgrad_pitch``):
    group g's tokens sit at columns ``[a_g, a_g + M_g)``, ``a_g = sum_{h<g} round_up(M_h, 128)``
    (``groups.aligned_token_offsets``), and every other column is 0 (the <= 127 between groups and the
    tail ``[a_G, P)``); and ``s`` FP32 ``[M//128 + G, K]``: row ``B_g + j`` holds block j of group g
    (``B_g`` = blocks of the groups before g), rows past the last used block 0. M == 0 gives zeros
    ``[K, 128 G]`` and ``[G, K]``. Both backends write every byte (the same bytes).
    """
    groups = _check_grouped_args(x, groups, pow2, num_groups, "quantize_grouped_128x1")
    _ext.check_backend(backend, x.device)
    return run_grouped_128x1(x, groups, pow2, backend)


def run_grouped_128x1(x: torch.Tensor, groups: Groups, pow2: bool, backend: str):
    """`quantize_grouped_128x1` without its argument rules (as `run_1x128`)."""
    return ops.kernel("quantize_grouped_128x1", backend == "reference")(x, groups.tensor, groups.num_groups, pow2)


def quantize_1x128_and_grouped_128x1(
    x: torch.Tensor,
    groups: torch.Tensor,
    pow2: bool = False,
    num_groups: Optional[int] = None,
    *,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_1x128(x) + quantize_grouped_128x1(x, groups)`` from one read of x.

    Same arguments and rules as ``quantize_grouped_128x1``; returns ``(q, s, qt, s_t)``: the 1x128
    q and scales (dgrad's / the forward's operand) and the per-group transposed qt and token-block
    scales (wgrad's operand), byte for byte what the two separate calls return.
    """
    groups = _check_grouped_args(x, groups, pow2, num_groups, "quantize_1x128_and_grouped_128x1")
    _ext.check_backend(backend, x.device)
    return run_1x128_and_grouped_128x1(x, groups, pow2, backend)


def run_1x128_and_grouped_128x1(x: torch.Tensor, groups: Groups, pow2: bool, backend: str):
    """`quantize_1x128_and_grouped_128x1` without its argument rules (as `run_1x128`)."""
    return ops.kernel("quantize_1x128_and_grouped_128x1", backend == "reference")(x, groups.tensor, groups.num_groups,
                                                                                  pow2)


def run_gather_1x128_and_grouped_128x1(x: torch.Tensor, rows: torch.Tensor, groups: Groups, pow2: bool, backend: str):
    """`run_1x128_and_grouped_128x1` of the gathered rows `x[rows]` (rows: int32 `[M]` on x's device, each in
    `[0, x.shape[0])`; groups describe the M gathered rows), the gather fused into the kernel's read: the same
    bytes, and the gathered BF16 rows are never written (megatron_tma.permutation)."""
    return ops.kernel("gather_quantize_1x128_and_grouped_128x1", backend == "reference")(x, rows, groups.tensor,
                                                                                         groups.num_groups, pow2)
