"""K-grouped (weight-gradient) FP8 GEMM benchmark: dW [G, N, K] from M tokens, for each forward configuration of
the m-grouped benchmark, reported like for like (docs/design.md §5). Every configuration gives two rows, told apart by
the field "out":

  "out": "bf16"      ours writing a BF16 [G, N, K] (out_dtype=torch.bfloat16, no accumulation), against the BF16
                     PyTorch user's wgrad: BF16 torch._grouped_mm 2d-2d (`bf16`) and the FP8 one PyTorch offers,
                     torch._scaled_grouped_mm 2d-2d with row-wise FP32 scales and BF16 out (`torch_rowwise`);
                     both need non-empty groups of a multiple of 16 tokens, so their operands are the tokens
                     copied into such groups (an empty group gets 16 zero tokens), built before timing.
  "out": "fp32_acc"  ours accumulating into Megatron's FP32 main_grad (out=main_grad, accumulate=True). PyTorch
                     has no grouped GEMM that accumulates into FP32 (torch._grouped_mm with out_dtype=float32
                     leaves its CUTLASS path for a loop over groups), so the row's reference figure is
                     `bf16_fp32_acc`: what a BF16 user does for main_grad, the BF16 torch._grouped_mm and then
                     main_grad.add_ of its result (the product is rounded to BF16 before the add: not the same
                     numbers, a time to compare). These rows carry no `bf16` or `torch_rowwise` field
                     (target checks read those on BF16 rows only).

Both kinds also time, on the same operands:
  padded_path   our FP8 operand columns gathered into 128-aligned groups (one index_select per operand, the
                scales copied) + the same kernel on the padded layout;
  padded_gemm   that kernel alone on the padded layout;
and the BF16 rows `dense_cublas` (torch._scaled_mm, same FLOPs, BF16 out; timed once per (M, N, K): it does
not depend on the group sizes, so the rows of the other distributions repeat the first one's time).

Whenever `import deep_gemm` succeeds, the fp32_acc rows also time DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM),
`deepgemm`: its K-grouped FP8 wgrad (k_grouped_fp8_gemm_nt_contiguous, which writes FP32 and accumulates into C,
so it has no place on the BF16 rows) on the same FP8 bytes and scales, laid out as it requires (each group
round_up(M_g, 128) tokens, K-major blocks concatenated: benchmarks/deepgemm_baseline.py), accumulating into the
same main_grad. That layout and the host list of group sizes are built before timing and not timed; one untimed
call (its JIT compile per shape) gives `deepgemm_bitexact`: torch.equal of its result with ours accumulated into
the same non-zero C. Without deep_gemm those fields are absent and the run says so once; the JSON's top level
records `deepgemm_present` and `deepgemm_version`.

The padded operands are exactly what quantize_grouped_128x1 gives on x with zero rows inserted so that every
group has round_up(M_g, 128) rows, called with sizes round_up(M_g, 128); they are built by a column gather of
our [K, P] operands (padded_column_index) and checked once per configuration against that quantizer call, so
the run also proves the two layouts agree (and that every column of ours outside the groups is zero).

Every row: ours_ms, roofline_ms (max(2MNK / dense FP8 rate, bytes / copy bandwidth), both measured in this run;
bytes = the FP8 operands and their token-block scales plus the output: 2 bytes per element written for BF16,
4 read + 4 written for the FP32 accumulate), ours_over_roofline, tokens_per_group (M / G), bitexact (ours equals
the padded GEMM, torch.equal on the same output kind; the FP32 rows accumulate into the same non-zero C) and
speedup_vs_<base> (base_ms / ours_ms) for each baseline the row has (with DeepGEMM: deepgemm_ms,
deepgemm_tflops, deepgemm_bitexact, speedup_vs_deepgemm on the fp32_acc rows). Our kernel's two tiles are timed beside the default on every
row, not as baselines: ours_block_m (the rows the default takes, megatron_tma.gemm.k_grouped_tile), ours_m128_ms
and ours_m192_ms (block_m forced), m128_bitexact / m192_bitexact (torch.equal with the default's output),
ours_m192_vs_m128 (m128_ms / m192_ms), ours_vs_best_tile (the faster forced tile's ms / ours_ms: below 1 where
the default chose the slower tile) and ours_vs_same_tile (ours_ms over the same tile forced: the identical call, so
a check of the timing schedule, 1.0 up to noise).

    python benchmarks/bench_k_grouped.py [--quick] [--iters 25] [--out DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import deepgemm_baseline  # noqa: E402
from bench_m_grouped import DISTS, MORE, TABLE, geomean, rowwise_fp8  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm, k_grouped_tile  # noqa: E402
from megatron_tma.groups import WGRAD_ALIGN, make_group_sizes, wgrad_pitch  # noqa: E402

OUT_KINDS = ("bf16", "fp32_acc")
# Methods timed per output kind, ours first; the others are the row's baselines (speedup_vs_<base>).
METHODS = {"bf16": ("ours", "padded_path", "padded_gemm", "torch_rowwise", "bf16", "dense_cublas"),
           "fp32_acc": ("ours", "padded_path", "padded_gemm", "bf16_fp32_acc")}
# Baselines timed only where their library imports (timing_plan's deepgemm=True): DeepGEMM writes FP32 only.
OPTIONAL_METHODS = {"bf16": (), "fp32_acc": ("deepgemm",)}
# Our kernel on each tile forced (block_m=128: two math warpgroups; 192: three), timed beside the default to check
# the tile choice; not baselines (their bits must be ours: m128_bitexact, m192_bitexact).
TILE_METHODS = {"bf16": ("ours_m128", "ours_m192"), "fp32_acc": ("ours_m128", "ours_m192")}
# Output bytes per [G, N, K] element in the roofline: BF16 written; FP32 main_grad read and written.
OUT_BYTES = {"bf16": 2, "fp32_acc": 8}
BIG_GROUP_TOKENS = 2048  # the issue's "large groups" (geomean target): M >= 2048 G, as check-targets filters
PAD_ALIGN = 128          # the padded baseline's group alignment (DeepGEMM's K-grouped wgrad needs 128)


# ---------------------------------------------------------------------------------------------------------------
# Layout bookkeeping (pure Python, CPU-tested in tests/test_bench_protocol.py)
# ---------------------------------------------------------------------------------------------------------------
def round_up(v: int, a: int) -> int:
    return -(-v // a) * a


def group_starts(sizes, align: int) -> list:
    """[G+1] exclusive prefix sums of round_up(M_g, align): align=WGRAD_ALIGN gives our column starts a_g (and
    a_G)."""
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + round_up(s, align))
    return starts


def padded_sizes(sizes, align: int = PAD_ALIGN) -> list:
    return [round_up(s, align) for s in sizes]


def token_columns(sizes) -> list:
    """Our column a_g + t of every token (groups in order): the only columns of qt that may be non-zero."""
    a = group_starts(sizes, WGRAD_ALIGN)
    return [c for g, s in enumerate(sizes) for c in range(a[g], a[g] + s)]


def scatter_rows(sizes, dst_sizes) -> list:
    """Destination row of every source row when group g's M_g rows move to the start of a group of dst_sizes[g]
    rows (dst_sizes[g] >= M_g; the other rows of the destination are zero)."""
    dst = group_starts(dst_sizes, 1)
    return [r for g, s in enumerate(sizes) for r in range(dst[g], dst[g] + s)]


def padded_column_index(sizes, align: int = PAD_ALIGN) -> list:
    """Source column in our [K, P] operand of every column of the padded operand [K, P_pad]: what
    quantize_grouped_128x1 returns for x with zero rows inserted so that group g has round_up(M_g, align) rows
    (P_pad = wgrad_pitch(sum of those, G)). Group g's tokens sit at our columns a_g + t; every padding column and
    the padded tail read our last column P - 1, which is always zero: the tail [a_G, P) has
    P - a_G >= round_up(M, A) + A G - (M + (A - 1) G) >= G >= 1 columns (A = WGRAD_ALIGN)."""
    G, m = len(sizes), sum(sizes)
    zero = wgrad_pitch(m, G) - 1
    a = group_starts(sizes, WGRAD_ALIGN)
    idx = []
    for g, s in enumerate(sizes):
        idx += range(a[g], a[g] + s)
        idx += [zero] * (round_up(s, align) - s)
    idx += [zero] * (wgrad_pitch(len(idx), G) - len(idx))
    return idx


def roofline_bytes(G: int, M: int, N: int, K: int, out: str) -> int:
    """Bytes a wgrad must move at least: both FP8 operands, their token-block scales, and the output
    (OUT_BYTES per element)."""
    return (N + K) * M + (M // 128 + G) * (N + K) * 4 + OUT_BYTES[out] * G * N * K


def roofline_ms(G: int, M: int, N: int, K: int, out: str, ceilings: dict) -> float:
    """The row's roofline: max(2MNK / dense FP8 rate, roofline_bytes / copy bandwidth), ceilings of this run."""
    flops = 2.0 * M * N * K
    return max(flops / (ceilings["dense_fp8_tflops"] * 1e9),
               roofline_bytes(G, M, N, K, out) / (ceilings["copy_tbps"] * 1e9))


def methods(kind: str, deepgemm: bool = False) -> tuple:
    """The methods of an out kind's rows, ours first; with deepgemm=True also the optional baselines."""
    return METHODS[kind] + (OPTIONAL_METHODS[kind] if deepgemm else ())


def timing_plan(configs, deepgemm: bool = False) -> list:
    """Per configuration ((G, M, N, K), dist), the methods it times as 'method@out' names; dense_cublas only at
    the first configuration of its (M, N, K); deepgemm@fp32_acc when deepgemm=True (deep_gemm imports)."""
    seen, plan = set(), []
    for (G, M, N, K), _dist in configs:
        plan.append([f"{m}@{kind}" for kind in OUT_KINDS for m in methods(kind, deepgemm) + TILE_METHODS[kind]
                     if not (m == "dense_cublas" and (M, N, K) in seen)])
        seen.add((M, N, K))
    return plan


def timed_calls(configs, iters: int, deepgemm: bool = False) -> int:
    """Timed calls of a run (each after an L2 flush); common.bench_interleaved adds 5 untimed warm-up calls per
    method."""
    return iters * sum(len(names) for names in timing_plan(configs, deepgemm))


def assign_timings(rows: dict, results: dict, flops: float) -> None:
    """Spread bench_interleaved's {'method@out': ms or error text} over rows {out: row}: `<method>_ms` and
    `<method>_tflops` (useful FLOPs), or `<method>_error` for a method that could not run."""
    for key, res in results.items():
        method, kind = key.split("@")
        row = rows[kind]
        if isinstance(res, str):
            row[f"{method}_error"] = res
        else:
            row[f"{method}_ms"] = round(res, 5)
            row[f"{method}_tflops"] = round(flops / res / 1e9, 1)


def finish_row(row: dict) -> dict:
    """ours_over_roofline and speedup_vs_<base> (base_ms / ours_ms) for every baseline of the row's kind present."""
    if row.get("ours_ms"):
        row["ours_over_roofline"] = round(row["ours_ms"] / row["roofline_ms"], 3)
        for base in methods(row["out"], deepgemm=True)[1:]:
            if row.get(f"{base}_ms"):
                row[f"speedup_vs_{base}"] = round(row[f"{base}_ms"] / row["ours_ms"], 4)
        if row.get("ours_m128_ms") and row.get("ours_m192_ms"):
            row["ours_m192_vs_m128"] = round(row["ours_m128_ms"] / row["ours_m192_ms"], 4)
            row["ours_vs_best_tile"] = round(min(row["ours_m128_ms"], row["ours_m192_ms"]) / row["ours_ms"], 4)
        twin = row.get(f"ours_m{row.get('ours_block_m')}_ms")  # the identical call, its tile forced
        if twin:
            row["ours_vs_same_tile"] = round(row["ours_ms"] / twin, 4)
    return row


def is_big(row: dict) -> bool:
    return row["M"] >= BIG_GROUP_TOKENS * row["G"]


def _gm(xs):
    xs = [x for x in xs if x]
    return round(geomean(xs), 4) if xs else None


def _min(xs):
    xs = [x for x in xs if x]
    return min(xs) if xs else None


def summarize(rows) -> dict:
    """The run's figures against the issue's targets: worst ours/roofline (per out kind and over all rows),
    geomean ours/roofline over rows with >= 2048 tokens per group, geomean and min speedup vs torch rowwise
    (the rows that have it: BF16 ones) and vs bf16 (BF16 rows only), vs the padded path per kind, all_bitexact."""
    s = {}
    for kind in OUT_KINDS:
        rs = [r for r in rows if r["out"] == kind]
        s[f"max_ours_over_roofline_{kind}"] = max((r["ours_over_roofline"] for r in rs if "ours_over_roofline" in r),
                                                  default=None)
        s[f"geomean_ours_over_roofline_big_groups_{kind}"] = _gm(
            [r.get("ours_over_roofline") for r in rs if is_big(r)])
        s[f"geomean_vs_padded_path_{kind}"] = _gm([r.get("speedup_vs_padded_path") for r in rs])
        s[f"min_vs_padded_gemm_{kind}"] = _min([r.get("speedup_vs_padded_gemm") for r in rs])
    s["max_ours_over_roofline"] = max((r["ours_over_roofline"] for r in rows if "ours_over_roofline" in r),
                                      default=None)
    s["geomean_ours_over_roofline_big_groups"] = _gm([r.get("ours_over_roofline") for r in rows if is_big(r)])
    tr = [r.get("speedup_vs_torch_rowwise") for r in rows]
    bf = [r.get("speedup_vs_bf16") for r in rows if r["out"] == "bf16"]
    s["geomean_vs_torch_rowwise"], s["min_vs_torch_rowwise"] = _gm(tr), _min(tr)
    s["geomean_vs_bf16"], s["min_vs_bf16"] = _gm(bf), _min(bf)
    s["geomean_vs_bf16_fp32_acc"] = _gm([r.get("speedup_vs_bf16_fp32_acc") for r in rows if r["out"] == "fp32_acc"])
    s["all_bitexact"] = bool(rows) and all(r.get("bitexact") is True for r in rows)
    dg = [r.get("speedup_vs_deepgemm") for r in rows if r["out"] == "fp32_acc"]
    s["geomean_vs_deepgemm"], s["min_vs_deepgemm"] = _gm(dg), _min(dg)
    dg_bits = [r["deepgemm_bitexact"] for r in rows if "deepgemm_bitexact" in r]
    s["all_deepgemm_bitexact"] = all(b is True for b in dg_bits) if dg_bits else None
    for kind in OUT_KINDS:  # the 192-row tile against the 128-row one, on every row and on large groups
        rs = [r for r in rows if r["out"] == kind]
        s[f"geomean_ours_m192_vs_m128_{kind}"] = _gm([r.get("ours_m192_vs_m128") for r in rs])
        s[f"geomean_ours_m192_vs_m128_big_groups_{kind}"] = _gm([r.get("ours_m192_vs_m128") for r in rs if is_big(r)])
    s["min_ours_vs_best_tile"] = _min([r.get("ours_vs_best_tile") for r in rows])
    # a check of the schedule: the default call against itself with its tile forced, 1.0 up to noise when no column
    # gains or loses by its place in the rounds (common.bench_interleaved)
    same = [r["ours_vs_same_tile"] for r in rows if r.get("ours_vs_same_tile")]
    s["max_ours_vs_same_tile"] = max(same) if same else None
    tile_bits = [r[f"m{b}_bitexact"] for r in rows for b in (128, 192) if f"m{b}_bitexact" in r]
    s["all_tiles_bitexact"] = all(b is True for b in tile_bits) if tile_bits else None
    return s


# ---------------------------------------------------------------------------------------------------------------
# One configuration on the GPU
# ---------------------------------------------------------------------------------------------------------------
def _u8(t):
    return t.view(torch.uint8)


def check_layout(name, qt, s, sizes, K, tokens):
    """Our operand is the contiguous [K, P] of the spec with [M // 128 + G, K] scales, zero outside the groups."""
    G, M = len(sizes), sum(sizes)
    P = wgrad_pitch(M, G)
    if tuple(qt.shape) != (K, P) or not qt.is_contiguous() or tuple(s.shape) != (M // 128 + G, K):
        raise AssertionError(f"{name}: quantize_grouped_128x1 gave qt {tuple(qt.shape)} (contiguous: "
                             f"{qt.is_contiguous()}) and scales {tuple(s.shape)}; the layout is a contiguous "
                             f"[K, P] = {(K, P)} with [M // 128 + G, K] = {(M // 128 + G, K)} scales")
    outside = torch.ones(P, dtype=torch.bool, device=qt.device)
    outside[tokens] = False
    if bool(_u8(qt)[:, outside].any()):
        raise AssertionError(f"{name}: qt has non-zero bytes outside the groups' columns")


def run_config(G, M, N, K, dist, seed, iters, ceilings, names, dense_cache, dev="cuda", dg=None):
    """The two rows [bf16, fp32_acc] of one configuration; `names` is its timing_plan entry, dense_cache
    {(M, N, K): dense_cublas time} carries that time to the other distributions; dg the deep_gemm module when
    `names` holds deepgemm@fp32_acc. (dev="cpu": the CPU test's dry run on the reference backend, timing faked.)"""
    gen = torch.Generator(device=dev).manual_seed(seed)
    sizes_t = make_group_sizes(M, G, dist, seed)
    sizes = sizes_t.tolist()
    groups = sizes_t.to(dev)
    x = torch.randn(M, K, generator=gen, device=dev).bfloat16()
    dy = torch.randn(M, N, generator=gen, device=dev).bfloat16()
    xt, xs = quant.quantize_grouped_128x1(x, groups)
    dyt, dys = quant.quantize_grouped_128x1(dy, groups)
    tokens = torch.tensor(token_columns(sizes), dtype=torch.int64, device=dev)
    check_layout("x", xt, xs, sizes, K, tokens)
    check_layout("dy", dyt, dys, sizes, N, tokens)
    del tokens

    # The padded layout: our columns gathered into 128-aligned groups, scales copied (rows past the used blocks
    # are zero in both); checked against quantizing the padded x.
    psizes = padded_sizes(sizes)
    mp = sum(psizes)
    pgroups = torch.tensor(psizes, dtype=torch.int64, device=dev)
    pidx = torch.tensor(padded_column_index(sizes), dtype=torch.int64, device=dev)
    xt_p = torch.empty(K, pidx.numel(), dtype=xt.dtype, device=dev)
    dyt_p = torch.empty(N, pidx.numel(), dtype=dyt.dtype, device=dev)
    xs_p = torch.zeros(mp // 128 + G, K, device=dev)
    dys_p = torch.zeros(mp // 128 + G, N, device=dev)
    mb = xs.shape[0]

    def pad_operands():
        torch.index_select(_u8(xt), 1, pidx, out=_u8(xt_p))
        torch.index_select(_u8(dyt), 1, pidx, out=_u8(dyt_p))
        xs_p[:mb].copy_(xs)
        dys_p[:mb].copy_(dys)

    pad_operands()
    dest = torch.tensor(scatter_rows(sizes, psizes), dtype=torch.int64, device=dev)
    for name, t, q_p, s_p in (("x", x, xt_p, xs_p), ("dy", dy, dyt_p, dys_p)):
        t_pad = torch.zeros(mp, t.shape[1], dtype=t.dtype, device=dev)
        t_pad[dest] = t
        rq, rs = quant.quantize_grouped_128x1(t_pad, pgroups)
        if rq.shape != q_p.shape or not torch.equal(_u8(rq), _u8(q_p)) or not torch.equal(rs, s_p):
            raise AssertionError(f"{name}: our columns gathered into 128-aligned groups differ from "
                                 "quantize_grouped_128x1 on the zero-padded input")
        del t_pad, rq, rs
    del dest

    flops = 2.0 * M * N * K
    base = {"G": G, "M": M, "N": N, "K": K, "dist": dist, "seed": seed, "tokens_per_group": M / G,
            "empty_groups": sum(1 for s in sizes if s == 0), "min_group": min(sizes), "max_group": max(sizes),
            "pad_tokens_frac": round(mp / M - 1, 4)}
    rows = {kind: dict(base, out=kind, roofline_ms=round(roofline_ms(G, M, N, K, kind, ceilings), 5))
            for kind in OUT_KINDS}

    # Bits (untimed): ours against the same kernel on the padded layout, per output kind.
    bf16 = torch.bfloat16
    main_grad = torch.randn(G, N, K, generator=gen, device=dev)  # a non-zero C: D = C + A.B
    rows["bf16"]["bitexact"] = bool(torch.equal(
        k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16),
        k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, out_dtype=bf16)))
    c_ours, c_pad = main_grad.clone(), main_grad.clone()
    k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=c_ours, accumulate=True)
    k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, out=c_pad, accumulate=True)
    rows["fp32_acc"]["bitexact"] = bool(torch.equal(c_ours, c_pad))
    for kind, out_dtype in (("bf16", bf16), ("fp32_acc", torch.float32)):  # each forced tile's bits: the default's
        if dev == "cuda":  # the reference backend (the CPU dry run) has no tiles
            rows[kind]["ours_block_m"] = k_grouped_tile(N, K, G, out_dtype)[0]
        for bm in (128, 192):
            if f"ours_m{bm}@{kind}" not in names:
                continue
            if kind == "bf16":
                same = torch.equal(k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16, block_m=bm),
                                   k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16))
            else:
                k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=c_pad.copy_(main_grad), accumulate=True, block_m=bm)
                same = torch.equal(c_pad, c_ours)
            rows[kind][f"m{bm}_bitexact"] = bool(same)
    del c_pad

    # DeepGEMM's operands (built here, not timed); this untimed call is also its JIT warm-up for the shape.
    dg_args = None
    if "deepgemm@fp32_acc" in names:
        if dg is None:
            raise ValueError("deepgemm@fp32_acc is in the timing plan but no deep_gemm module was given")
        try:
            dg_args = deepgemm_baseline.k_grouped_args(dyt, dys, xt, xs, sizes)
            c_dg = main_grad.clone()
            deepgemm_baseline.run_k_grouped(dg, dg_args, c_dg)
            rows["fp32_acc"]["deepgemm_bitexact"] = bool(torch.equal(c_dg, c_ours))
            del c_dg
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is recorded, not fatal
            rows["fp32_acc"]["deepgemm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            names = [n for n in names if n != "deepgemm@fp32_acc"]
            dg_args = None
    del c_ours

    # torch's 2d-2d grouped GEMMs: non-empty groups of a multiple of 16 tokens (not timed: built once)
    s16 = [max(round_up(s, 16), 16) for s in sizes]
    offs16 = torch.tensor(group_starts(s16, 1)[1:], dtype=torch.int32, device=dev)
    dest16 = torch.tensor(scatter_rows(sizes, s16), dtype=torch.int64, device=dev)
    x16 = torch.zeros(sum(s16), K, dtype=x.dtype, device=dev)
    dy16 = torch.zeros(sum(s16), N, dtype=dy.dtype, device=dev)
    x16[dest16], dy16[dest16] = x, dy
    del x, dy, dest16
    xr, xr_s = rowwise_fp8(x16.t().contiguous())     # [K, M16], one scale per row over its tokens
    dyr, dyr_s = rowwise_fp8(dy16.t().contiguous())  # [N, M16]
    xr_s, dyr_s = xr_s.repeat(G), dyr_s.repeat(G)

    def padded_path(**kw):
        pad_operands()
        return k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, **kw)

    acc = {"out": main_grad, "accumulate": True}
    fns = {
        "ours@bf16": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16),
        "padded_path@bf16": lambda: padded_path(out_dtype=bf16),
        "padded_gemm@bf16": lambda: k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, out_dtype=bf16),
        "torch_rowwise@bf16": lambda: torch._scaled_grouped_mm(dyr, xr.t(), dyr_s, xr_s, offs=offs16,
                                                               out_dtype=bf16),
        "bf16@bf16": lambda: torch._grouped_mm(dy16.t(), x16, offs=offs16),
        "ours@fp32_acc": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, **acc),
        "ours_m128@bf16": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16, block_m=128),
        "ours_m192@bf16": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=bf16, block_m=192),
        "ours_m128@fp32_acc": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, block_m=128, **acc),
        "ours_m192@fp32_acc": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, block_m=192, **acc),
        "padded_path@fp32_acc": lambda: padded_path(**acc),
        "padded_gemm@fp32_acc": lambda: k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, **acc),
        "bf16_fp32_acc@fp32_acc": lambda: main_grad.add_(torch._grouped_mm(dy16.t(), x16, offs=offs16)),
    }
    if dg_args is not None:
        fns["deepgemm@fp32_acc"] = lambda: deepgemm_baseline.run_k_grouped(dg, dg_args, main_grad)
    if "dense_cublas@bf16" in names:
        a_d = _u8(dyt)[:, :M].contiguous().view(dyt.dtype)        # [N, M] row-major, any FP8 data: same FLOPs
        b_d = _u8(xt)[:, :M].contiguous().view(xt.dtype).t()      # [M, K] column-major
        one = torch.ones((), device=dev)
        fns["dense_cublas@bf16"] = lambda: torch._scaled_mm(a_d, b_d, one, one, out_dtype=bf16)
    missing = set(names) - set(fns)
    if missing:
        raise KeyError(f"no callable for {sorted(missing)}")
    results = common.bench_interleaved({n: fns[n] for n in names}, iters=iters)
    if "dense_cublas@bf16" in results:
        dense_cache[(M, N, K)] = results["dense_cublas@bf16"]
    elif (M, N, K) in dense_cache:
        results["dense_cublas@bf16"] = dense_cache[(M, N, K)]
    assign_timings(rows, results, flops)
    return [finish_row(rows[kind]) for kind in OUT_KINDS]


# ---------------------------------------------------------------------------------------------------------------
def _f(row, key, fmt="8.3f"):
    v = row.get(key)
    return format(v, fmt) if isinstance(v, (int, float)) else format("-", ">" + fmt.split(".")[0])


def print_table(rows):
    dg = any("deepgemm_ms" in r or "deepgemm_bitexact" in r or "deepgemm_error" in r for r in rows)
    print(f"\n{'G':>3} {'M':>6} {'N':>5} {'K':>5} {'dist':>8} {'out':>8} {'ours_ms':>8} {'roof_ms':>8} {'x_roof':>6} "
          f"{'padpath':>8} {'padgemm':>8} {'rowwise':>8} {'bf16':>8} {'bf16+acc':>8} {'x_bf16':>6} {'x_rw':>6}"
          + (f" {'deepgemm':>8} {'x_dg':>6} {'dg_exact':>8}" if dg else "") + "  exact")
    for r in rows:
        print(f"{r['G']:>3} {r['M']:>6} {r['N']:>5} {r['K']:>5} {r['dist']:>8} {r['out']:>8} {_f(r, 'ours_ms')} "
              f"{_f(r, 'roofline_ms')} {_f(r, 'ours_over_roofline', '6.2f')} {_f(r, 'padded_path_ms')} "
              f"{_f(r, 'padded_gemm_ms')} {_f(r, 'torch_rowwise_ms')} {_f(r, 'bf16_ms')} {_f(r, 'bf16_fp32_acc_ms')} "
              f"{_f(r, 'speedup_vs_bf16', '6.2f')} {_f(r, 'speedup_vs_torch_rowwise', '6.2f')}"
              + (f" {_f(r, 'deepgemm_ms')} {_f(r, 'speedup_vs_deepgemm', '6.2f')} "
                 f"{r.get('deepgemm_bitexact', '-')!s:>8}" if dg else "") + f"  {r['bitexact']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the five reference rows (docs/design.md §5), paper distribution only")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default=None, help="also copy the JSON and PNG here")
    args = ap.parse_args()
    configs = [(c, "paper") for c in TABLE] if args.quick else [(c, d) for c in TABLE + MORE for d in DISTS]
    dg, dg_why = deepgemm_baseline.load()
    if dg is None:
        print(f"DeepGEMM is not importable ({dg_why}): no deepgemm columns in this run", flush=True)
    else:
        print(f"DeepGEMM {deepgemm_baseline.version(dg)}: timed on the fp32_acc rows", flush=True)
    plan = timing_plan(configs, deepgemm=dg is not None)
    print(f"{len(configs)} configurations, {2 * len(configs)} rows, "
          f"{timed_calls(configs, args.iters, deepgemm=dg is not None)} timed calls", flush=True)
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows, dense_cache = [], {}
    for i, (((G, M, N, K), dist), names) in enumerate(zip(configs, plan)):
        print(f"[{i + 1}/{len(configs)}] G={G} M={M} N={N} K={K} {dist}: {len(names)} methods ...", flush=True)
        bf, fa = run_config(G, M, N, K, dist, 2000 + i, args.iters, ceilings, names, dense_cache, dg=dg)
        rows += [bf, fa]
        print(f"    bf16: ours {bf.get('ours_ms')} ms ({bf.get('ours_over_roofline')}x roofline), "
              f"x{bf.get('speedup_vs_bf16')} vs bf16, x{bf.get('speedup_vs_torch_rowwise')} vs torch rowwise, "
              f"x{bf.get('speedup_vs_padded_path')} vs padded path, bitexact={bf['bitexact']}, "
              f"tile rows {bf.get('ours_block_m')} (192 vs 128: x{bf.get('ours_m192_vs_m128')})", flush=True)
        print(f"    fp32_acc: ours {fa.get('ours_ms')} ms ({fa.get('ours_over_roofline')}x roofline), "
              f"x{fa.get('speedup_vs_padded_path')} vs padded path, x{fa.get('speedup_vs_bf16_fp32_acc')} vs "
              f"bf16 + add, bitexact={fa['bitexact']}, tile rows {fa.get('ours_block_m')} (192 vs 128: "
              f"x{fa.get('ours_m192_vs_m128')})"
              + (f", x{fa.get('speedup_vs_deepgemm')} vs DeepGEMM (bitexact={fa.get('deepgemm_bitexact')})"
                 if dg is not None else ""), flush=True)
        for r in (bf, fa):
            for key in [k for k in r if k.endswith("_error")]:
                print(f"    {r['out']} {key}: {r[key]}", flush=True)
        torch.cuda.empty_cache()
    summary = summarize(rows)
    command = "python benchmarks/bench_k_grouped.py" + (" --quick" if args.quick else "") + (
        f" --iters {args.iters}" if args.iters != 25 else "")
    path = common.write_result("k_grouped", rows, ceilings, command=command,
                               extra={"summary": summary, **deepgemm_baseline.result_fields(dg, dg_why)},
                               out_dir=args.out)
    plot(rows, path.replace(".json", ".png"), args.out)
    print(f"wrote {path}")
    print("summary:", summary)
    print_table(rows)


def plot(rows, png, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {kind: [r for r in rows if r["out"] == kind] for kind in OUT_KINDS}
    bf = by["bf16"]
    xs = list(range(len(bf)))
    labels = [f"G{r['G']} M{r['M'] // 1024}k\nN{r['N']} K{r['K']}\n{r['dist']}" for r in bf]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, 0.6 * len(bf)), 9), sharex=True)
    for j, kind in enumerate(OUT_KINDS):
        ax1.bar([x + (j - 0.5) * 0.4 for x in xs], [r.get("ours_over_roofline", 0) for r in by[kind]], 0.4,
                label=f"ours / roofline, {kind}")
    ax1.set_ylabel("time / roofline (lower is better)")
    ax1.set_title(f"K-grouped FP8 wgrad on {common.gpu_label()}: BF16 out and FP32 accumulate into main_grad")
    ax1.legend(fontsize=7)
    bars = [("bf16", bf, "BF16 out"), ("torch_rowwise", bf, "BF16 out")]
    if any("speedup_vs_deepgemm" in r for r in by["fp32_acc"]):
        bars.append(("deepgemm", by["fp32_acc"], "FP32 accumulate"))
    width = 0.8 / len(bars)
    for j, (base, rs, kind) in enumerate(bars):
        ax2.bar([x + (j - (len(bars) - 1) / 2) * width for x in xs], [r.get(f"speedup_vs_{base}", 0) for r in rs],
                width, label=f"speedup vs {base} ({kind})")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(1.3, color="tab:blue", lw=0.8, ls=":", label="target vs bf16: 1.3x (geomean)")
    ax2.axhline(1.2, color="tab:green", lw=0.8, ls=":", label="target vs DeepGEMM: 1.2x (geomean), 1.0x (every row "
                                                               "with >= 1024 tokens per group)")
    ax2.set_ylabel("baseline time / ours (higher is better)")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels, fontsize=6)
    ax2.legend(fontsize=7)
    common.save_figure(fig, png, out_dir)


if __name__ == "__main__":
    main()
