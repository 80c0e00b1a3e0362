"""DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM) as a side-by-side baseline: our FP8 operands laid out as its SM90 grouped
kernels take them, and its two calls. Used by benchmarks/bench_m_grouped.py, benchmarks/bench_k_grouped.py and
tests/test_deepgemm_gpu.py; the layout conversions are CPU-tested in tests/test_deepgemm_layout.py.

DeepGEMM is never a dependency of megatron_tma: `load()` imports it lazily and says why when it cannot.

Its SM90 kernels need every group padded to a multiple of 128 tokens (ALIGN); on the same FP8 bytes and scales
they gave the same bits as ours on an H200 (zero tokens contribute exact zeros; tests/test_deepgemm_gpu.py):

M-grouped (forward, dgrad), ``m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices)``:
  a    e4m3 [M_pad, K], group g's rows from the 128-aligned row P_g on, padding rows zero (pad_rows_fp8's a_pad);
  sfa  FP32 [M_pad, K/128], M-contiguous with the column stride a multiple of 4 (pad_rows_fp8's scales as they
       are: DeepGEMM then uses the same storage, no copy);
  b    e4m3 [G, N, K] with sfb FP32 [G, N/128, K/128] (quantize_128x128's weight and scales as they are);
  m_indices int32 [M_pad]: the group of each row, -1 on padding rows (and on the buffer's rows past the padded
       total); d BF16 [M_pad, N].
K-grouped (wgrad), ``k_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, ks, ks_tensor, c)``, FP32 only:
  with k_g = round_up(M_g, 128): a = group g's K-major [N, k_g] block of dY^T, the blocks concatenated into one
  flat e4m3 buffer (b likewise from X^T, [K, k_g] blocks); sfa FP32 [N, sum_g k_g / 128] MN-major: its column j
  is our token-block scale row j (the blocks of group g at B_g .. B_g + k_g/128 - 1, as ours); ks the host list,
  ks_tensor the same as int32 on the GPU; d FP32 [G, N, K] and c = d: accumulates into d.
"""
from typing import List, Optional, Sequence, Tuple

import torch

ALIGN = 128  # DeepGEMM's SM90 grouped layouts: each group's M (M-grouped) or K (K-grouped) a multiple of 128


def load():
    """(deep_gemm, None) when it imports, else (None, why in one line)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - any import failure (missing, no CUDA, ABI) means: no baseline
        text = str(e).splitlines()[0] if str(e) else ""
        return None, f"{type(e).__name__}: {text}" if text else type(e).__name__
    return deep_gemm, None


def version(dg) -> str:
    return str(getattr(dg, "__version__", "unknown"))


def check_alignment(dg) -> None:
    """DeepGEMM's M-grouped contiguous kernel takes its block_m from a process-wide setting (default 128); the
    padded operands here are 128-aligned, so refuse to run if something in the process changed it."""
    get = getattr(dg, "get_mk_alignment_for_contiguous_layout", None)
    if get is not None and get() != ALIGN:
        raise RuntimeError(f"deep_gemm's mk alignment for contiguous layouts is {get()}, the padded operands are "
                           f"{ALIGN}-aligned (deep_gemm.set_mk_alignment_for_contiguous_layout({ALIGN}))")


def result_fields(dg, why: Optional[str]) -> dict:
    """The result JSON's top-level record of the baseline: deepgemm_present, deepgemm_version (None when absent)
    and, when absent, deepgemm_absent_reason."""
    if dg is None:
        return {"deepgemm_present": False, "deepgemm_version": None, "deepgemm_absent_reason": why}
    return {"deepgemm_present": True, "deepgemm_version": version(dg)}


def round_up(v: int, a: int = ALIGN) -> int:
    return -(-v // a) * a


def _sizes(sizes) -> List[int]:
    vals = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if any(s < 0 for s in vals):
        raise ValueError(f"group sizes must be >= 0, got {vals}")
    return [int(s) for s in vals]


# ---------------------------------------------------------------------------------------------------------------
# M-grouped: pad_rows_fp8's padded operands, as DeepGEMM takes them
# ---------------------------------------------------------------------------------------------------------------
def m_indices(sizes, rows: int) -> torch.Tensor:
    """int32 [rows] on the CPU: g on the first M_g rows of group g's 128-aligned span, -1 elsewhere (the span's
    padding and the buffer's rows past sum_g round_up(M_g, 128))."""
    sizes = _sizes(sizes)
    total = sum(round_up(s) for s in sizes)
    if rows < total:
        raise ValueError(f"the padded buffer has {rows} rows, the groups need {total}")
    out = torch.full((rows,), -1, dtype=torch.int32)
    start = 0
    for g, s in enumerate(sizes):
        out[start:start + s] = g
        start += round_up(s)
    return out


def valid_rows(sizes) -> torch.Tensor:
    """int64 [M] on the CPU: the padded row of each of our M rows, in order (DeepGEMM's d[valid_rows] is ours)."""
    sizes = _sizes(sizes)
    idx, start = [], 0
    for s in sizes:
        idx += range(start, start + s)
        start += round_up(s)
    return torch.tensor(idx, dtype=torch.int64)


def m_grouped_args(a_pad: torch.Tensor, a_scales_pad: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                   sizes) -> Tuple[tuple, tuple, torch.Tensor]:
    """((a, sfa), (b, sfb), m_indices on a_pad's device) for m_grouped_fp8_gemm_nt_contiguous, from pad_rows_fp8's
    output (align=128) and our 128x128-quantized weights, without copying any operand."""
    rows, k = a_pad.shape
    if tuple(a_scales_pad.shape) != (rows, -(-k // 128)):
        raise ValueError(f"a_scales_pad must be [M_pad, K/128] = {(rows, -(-k // 128))}, got "
                         f"{tuple(a_scales_pad.shape)}")
    # Any other stride makes DeepGEMM transpose the scales inside every (timed) call.
    kb = a_scales_pad.shape[1]
    if (rows > 1 and a_scales_pad.stride(0) != 1) or (rows and kb > 1 and a_scales_pad.stride(1) % 4 != 0):
        raise ValueError(f"a_scales_pad must be M-contiguous with a column stride a multiple of 4, got strides "
                         f"{a_scales_pad.stride()}")
    if rows % ALIGN != 0:
        raise ValueError(f"the padded buffer's rows must be a multiple of {ALIGN}, got {rows}")
    idx = m_indices(sizes, rows).to(a_pad.device)
    return (a_pad, a_scales_pad), (w, w_scales), idx


def run_m_grouped(dg, args, d: torch.Tensor) -> torch.Tensor:
    a, b, idx = args
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, idx)
    return d


# ---------------------------------------------------------------------------------------------------------------
# K-grouped: our wgrad operands ([R, P] token columns, [MB, R] token-block scales), as DeepGEMM takes them
# ---------------------------------------------------------------------------------------------------------------
def k_grouped_ks(sizes) -> List[int]:
    """DeepGEMM's ks: round_up(M_g, 128). An empty group stays 0: DeepGEMM accepts k_g = 0 (its host code skips
    such groups when picking the first K, and its own k-grouped test empties a group) and leaves d[g] = c[g], as
    ours does, so no zero tokens are invented for it."""
    return [round_up(s) for s in _sizes(sizes)]


def k_grouped_operand(qt: torch.Tensor, scales: torch.Tensor, sizes,
                      starts: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flat e4m3 [sum_g R k_g], FP32 [R, sum_g k_g/128] MN-major) from our [R, P] operand and its [MB, R] scales.

    starts: group g's first column a_g in qt (default: groups.aligned_token_offsets). Only columns
    [a_g, a_g + M_g) are read; each block is zero past M_g whatever qt holds there, so any column alignment works.
    """
    sizes = _sizes(sizes)
    r = qt.shape[0]
    if starts is None:
        from megatron_tma.groups import aligned_token_offsets

        starts = aligned_token_offsets(torch.tensor(sizes, dtype=torch.int64)).tolist()
    starts = [int(a) for a in starts]
    if len(starts) < len(sizes):
        raise ValueError(f"need a start column per group ({len(sizes)}), got {len(starts)}")
    ks = k_grouped_ks(sizes)
    flat = torch.zeros(r * sum(ks), dtype=torch.uint8, device=qt.device)
    src, off = qt.view(torch.uint8), 0
    for a, m, k in zip(starts, sizes, ks):
        if a + m > qt.shape[1]:
            raise ValueError(f"group at columns [{a}, {a + m}) is outside qt's {qt.shape[1]} columns")
        flat[off:off + r * k].view(r, k)[:, :m].copy_(src[:, a:a + m])
        off += r * k
    blocks = sum(ks) // ALIGN
    if scales.shape[0] < blocks or scales.shape[1] != r:
        raise ValueError(f"scales must be [>= {blocks}, {r}], got {tuple(scales.shape)}")
    # DeepGEMM wants stride(1) == round_up(R, 4) (its TMA alignment of FP32 rows) and copies otherwise, inside
    # the timed call: our scales already have it when R % 4 == 0 (always, for R a multiple of 128).
    if r % 4 == 0 and scales.stride() == (r, 1):
        sf = scales[:blocks].t()
    else:
        buf = torch.zeros(blocks, round_up(r, 4), dtype=torch.float32, device=scales.device)
        buf[:, :r] = scales[:blocks]
        sf = buf[:, :r].t()
    return flat.view(qt.dtype), sf


def k_grouped_args(dy_t, dy_t_scales, x_t, x_t_scales, sizes, starts: Optional[Sequence[int]] = None) -> dict:
    """Everything k_grouped_fp8_gemm_nt_contiguous takes but d and c: a (from dY^T), b (from X^T), ks (host list),
    ks_tensor (int32 on the operands' device). Built once, before any timing."""
    ks = k_grouped_ks(sizes)
    return {"a": k_grouped_operand(dy_t, dy_t_scales, sizes, starts),
            "b": k_grouped_operand(x_t, x_t_scales, sizes, starts),
            "ks": ks, "ks_tensor": torch.tensor(ks, dtype=torch.int32, device=dy_t.device)}


def run_k_grouped(dg, args: dict, d: torch.Tensor) -> torch.Tensor:
    """d[g] += dY_g^T . X_g in place (FP32 [G, N, K]): DeepGEMM's FP8 NT K-grouped call writes FP32 only and
    requires c, so the comparable use is Megatron's: accumulate into main_grad."""
    dg.k_grouped_fp8_gemm_nt_contiguous(args["a"], args["b"], d, args["ks"], args["ks_tensor"], d)
    return d
