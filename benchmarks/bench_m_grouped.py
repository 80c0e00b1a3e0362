"""M-grouped FP8 GEMM benchmark (docs/design.md §5): ours vs the padded path, the padded GEMM alone,
torch._scaled_grouped_mm (row-wise), BF16 torch._grouped_mm and one dense cuBLAS FP8 GEMM of equal FLOPs,
all in one process on the same inputs. Writes benchmarks/results/m_grouped-<stamp>.json and a PNG.

Whenever `import deep_gemm` succeeds, every row also times DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM), `deepgemm`:
m_grouped_fp8_gemm_nt_contiguous, BF16 out, on the padded GEMM's operands (our FP8 rows and scales padded to
128-row groups by pad_rows_fp8, our 128x128 weights as they are) with its m_indices (-1 on padding rows), all built
before timing and not timed (benchmarks/deepgemm_baseline.py). One untimed call (its JIT compile per shape) gives
`deepgemm_bitexact`: torch.equal of its valid rows with our unpadded output. Row fields: deepgemm_ms,
deepgemm_tflops, deepgemm_bitexact, speedup_vs_deepgemm (deepgemm_ms / ours_ms), or deepgemm_error. Without
deep_gemm those fields are absent and the run says so once; the JSON's top level records `deepgemm_present` and
`deepgemm_version`.

Our kernel's tiles are timed beside the default on every row (ours_m128, ours_m192, ours_bn192, ours_bn256: the tile
forced; ours_tile: the default's choice). ours_vs_same_tile is ours_ms over the forced call with the default's own
tile, the identical call: 1.0 up to noise when the schedule favours no column (summary: median and max).

    python benchmarks/bench_m_grouped.py [--quick] [--out DIR]
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import deepgemm_baseline  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import m_grouped_fp8_gemm, m_grouped_tile  # noqa: E402
from megatron_tma.groups import check_groups, make_group_sizes  # noqa: E402
from megatron_tma.padding import pad_rows_fp8, padded_m_grouped_fp8_gemm  # noqa: E402

# (G, M, N, K): docs/design.md §5's five rows first, then more of the paper's grid.
TABLE = [(8, 16384, 4096, 4096), (16, 32768, 7168, 4096), (32, 16384, 3072, 8192), (8, 65536, 6144, 5120),
         (32, 8192, 4096, 7168)]
MORE = [(4, 8192, 3072, 3072), (4, 32768, 8192, 8192), (16, 16384, 5120, 6144), (32, 65536, 4096, 7168),
        (8, 32768, 3072, 6144)]
DISTS = ("paper", "skewed", "balanced")


def rowwise_fp8(x):
    """Row-wise FP8 (one FP32 scale per row), the recipe torch._scaled_grouped_mm takes."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def make_inputs(G, M, N, K, dist, seed):
    """One configuration's operands: (group sizes on the CPU, groups on the GPU, x, w, FP8 x + scales, FP8 w +
    scales), the same for every caller with the same seed (time_m_grouped_rows.py times these rows too)."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    sizes = make_group_sizes(M, G, dist, seed)
    x = torch.randn(M, K, generator=gen, device=dev).bfloat16()
    w = (torch.randn(G, N, K, generator=gen, device=dev) * 0.05).bfloat16()
    aq, a_s = quant.quantize_1x128(x)
    wq, ws, _, _ = quant.quantize_128x128(w)
    return sizes, sizes.to(dev), x, w, aq, a_s, wq, ws


def row_seed(i):
    """The seed of the benchmark's row i (of the --quick or the full grid)."""
    return 1000 + i


def run_config(G, M, N, K, dist, seed, iters, dg=None):
    """One row; dg: the deep_gemm module, to time it too (None: no deepgemm fields)."""
    dev = "cuda"
    sizes, groups, x, w, aq, a_s, wq, ws = make_inputs(G, M, N, K, dist, seed)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    row = {"G": G, "M": M, "N": N, "K": K, "dist": dist, "seed": seed,
           "pad_rows_pct": round(100.0 * (int((-(-sizes // 128) * 128).sum()) - M) / M, 2),
           "max_group": int(sizes.max()), "empty_groups": int((sizes == 0).sum())}
    flops = 2.0 * M * N * K

    fns = {}
    fns["ours"] = lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out)
    # every tile shape (same bits): the evidence for the default's choice (scheduler/m_grouped_tile_choice.h)
    row["ours_tile"] = "%dx%d" % m_grouped_tile(M, N, G)
    fns["ours_m128"] = lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=128, block_n=128)
    fns["ours_m192"] = lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=192, block_n=128)
    fns["ours_bn192"] = lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=128, block_n=192)
    if N % 256 == 0:
        fns["ours_bn256"] = lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=128, block_n=256)
    fns["padded_path"] = lambda: padded_m_grouped_fp8_gemm(aq, a_s, wq, ws, groups)
    a_pad, a_s_pad, pad_off = pad_rows_fp8(aq, a_s, groups, 128, num_groups=G)
    fns["padded_gemm"] = lambda: m_grouped_fp8_gemm(a_pad, a_s_pad, wq, ws, pad_off)
    row["padded_gemm_tile"] = "%dx%d" % m_grouped_tile(a_pad.shape[0], N, G)  # its M is the padded buffer's
    if dg is not None:
        # The same padded operands; this untimed call is also DeepGEMM's JIT warm-up for the shape.
        try:
            deepgemm_baseline.check_alignment(dg)
            dg_args = deepgemm_baseline.m_grouped_args(a_pad, a_s_pad, wq, ws, sizes)
            d_dg = torch.empty(a_pad.shape[0], N, dtype=torch.bfloat16, device=dev)
            deepgemm_baseline.run_m_grouped(dg, dg_args, d_dg)
            valid = deepgemm_baseline.valid_rows(sizes).to(dev)
            row["deepgemm_bitexact"] = bool(torch.equal(d_dg[valid], m_grouped_fp8_gemm(aq, a_s, wq, ws, groups)))
            del valid
            fns["deepgemm"] = lambda: deepgemm_baseline.run_m_grouped(dg, dg_args, d_dg)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is recorded, not fatal
            row["deepgemm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    xr, xr_s = rowwise_fp8(x)
    wr, wr_s = rowwise_fp8(w)                      # [G, N, K] with scales [G, N]
    wr_t = wr.transpose(-2, -1)                    # [G, K, N], column-major per group
    offs = torch.cumsum(groups, 0).to(torch.int32)
    fns["torch_rowwise"] = lambda: torch._scaled_grouped_mm(xr, wr_t, xr_s, wr_s, offs=offs, out_dtype=torch.bfloat16)
    w_t = w.transpose(-2, -1)
    fns["bf16"] = lambda: torch._grouped_mm(x, w_t, offs=offs)
    dense_a = aq
    dense_b = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=dev).copy_(wq[0]).t()   # [K, N] column-major
    one = torch.ones((), device=dev)
    fns["dense_cublas"] = lambda: torch._scaled_mm(dense_a, dense_b, one, one, out_dtype=torch.bfloat16)

    common.time_methods(row, fns, flops, iters)
    same = same_tile_ratio(row)
    if same is not None:
        row["ours_vs_same_tile"] = same
    ours = m_grouped_fp8_gemm(aq, a_s, wq, ws, groups).clone()
    row["bitexact"] = bool(torch.equal(ours, padded_m_grouped_fp8_gemm(aq, a_s, wq, ws, groups)))
    if "padded_path_ms" in row and "ours_ms" in row:
        row["speedup_vs_padded_path"] = round(row["padded_path_ms"] / row["ours_ms"], 4)
        row["speedup_vs_padded_gemm"] = round(row["padded_gemm_ms"] / row["ours_ms"], 4)
    if "torch_rowwise_ms" in row:
        row["speedup_vs_torch_rowwise"] = round(row["torch_rowwise_ms"] / row["ours_ms"], 4)
    if "deepgemm_ms" in row and "ours_ms" in row:
        row["speedup_vs_deepgemm"] = round(row["deepgemm_ms"] / row["ours_ms"], 4)
    if "dense_cublas_ms" in row:
        row["ratio_vs_dense_cublas"] = round(row["dense_cublas_ms"] / row["ours_ms"], 4)
    return row


def host_overhead_us(calls=1000):
    """Wall time per call of a tiny problem issued back to back (host-side cost of one call): the wrapper with a
    raw group tensor (its argument rules, then the op), the wrapper with a checked `Groups` (as the expert MLP calls
    it), and the C++ op alone (its precondition checks, TMA descriptors, launch)."""
    dev = "cuda"
    G, M, N, K = 8, 256, 256, 128
    aq, a_s = quant.quantize_1x128(torch.randn(M, K, device=dev).bfloat16())
    wq, ws, _, _ = quant.quantize_128x128(torch.randn(G, N, K, device=dev).bfloat16())
    groups = make_group_sizes(M, G, "paper", 0).to(dev)
    checked = check_groups(groups, G, m_total=M)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    op = torch.ops.megatron_tma.m_grouped_fp8_gemm_out
    ways = {"wrapper": lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out),
            "wrapper_checked_groups": lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, checked, out=out),
            "op": lambda: op(aq, a_s, wq, ws, groups, out)}
    res = {}
    for name, call in ways.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        res[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return res


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


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
        print(f"DeepGEMM {deepgemm_baseline.version(dg)}: timed on every row", flush=True)
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    for i, ((G, M, N, K), dist) in enumerate(configs):
        row = run_config(G, M, N, K, dist, seed=row_seed(i), iters=args.iters, dg=dg)
        rows.append(row)
        print(f"[{i + 1}/{len(configs)}] G={G} M={M} N={N} K={K} {dist}: ours {row.get('ours_tflops')} TFLOPS, "
              f"x{row.get('speedup_vs_padded_path')} vs padded path, bitexact={row['bitexact']}"
              + (f", x{row.get('speedup_vs_deepgemm')} vs DeepGEMM (bitexact={row.get('deepgemm_bitexact')})"
                 if dg is not None else ""), flush=True)
        for key in [k for k in row if k.endswith("_error")]:
            print(f"    {key}: {row[key]}", flush=True)
    summary = {
        "geomean_vs_padded_path": geomean([r.get("speedup_vs_padded_path") for r in rows]),
        "min_vs_padded_path": min(r.get("speedup_vs_padded_path", 0) for r in rows),
        "min_vs_padded_gemm": min(r.get("speedup_vs_padded_gemm", 0) for r in rows),
        "geomean_vs_torch_rowwise": geomean([r.get("speedup_vs_torch_rowwise") for r in rows]),
        "median_tflops_m_ge_16384": sorted(r["ours_tflops"] for r in rows if r["M"] >= 16384)[
            len([r for r in rows if r["M"] >= 16384]) // 2] if any(r["M"] >= 16384 for r in rows) else None,
        "min_ratio_vs_dense_m65536": min((r.get("ratio_vs_dense_cublas", 0) for r in rows if r["M"] == 65536), default=None),
        "host_us_per_call": None,  # filled below
        "host_us_per_call_checked_groups": None,
        "host_us_per_call_op_only": None,
        "all_bitexact": all(r["bitexact"] for r in rows),
    }
    summary.update(deepgemm_summary(rows))
    summary.update(schedule_summary(rows))
    host = host_overhead_us()
    summary["host_us_per_call"] = round(host["wrapper"], 2)
    summary["host_us_per_call_checked_groups"] = round(host["wrapper_checked_groups"], 2)
    summary["host_us_per_call_op_only"] = round(host["op"], 2)
    path = common.write_result("m_grouped", rows, ceilings, command="python benchmarks/bench_m_grouped.py"
                               + (" --quick" if args.quick else ""),
                               extra={"summary": summary, **deepgemm_baseline.result_fields(dg, dg_why)},
                               out_dir=args.out)
    plot(rows, path.replace(".json", ".png"), args.out)
    print_table(rows, summary)
    print(f"wrote {path}")


# The forced-tile column that times the very call `ours` makes, by the default's tile (row["ours_tile"]).
SAME_TILE_COLUMN = {"128x128": "ours_m128_ms", "192x128": "ours_m192_ms", "128x192": "ours_bn192_ms",
                    "128x256": "ours_bn256_ms"}


def same_tile_ratio(row):
    """ours_ms over the time of the identical call forced to the default's tile, timed in the same rounds: a check
    of the schedule, 1.0 up to noise when no column is favoured by its place in the rounds (a rotation read up to
    x1.09 here, benchmarks/NOTES.md "Facts learned the hard way"). None without both times."""
    twin = row.get(SAME_TILE_COLUMN.get(row.get("ours_tile"), ""))
    return round(row["ours_ms"] / twin, 4) if twin and row.get("ours_ms") else None


def schedule_summary(rows) -> dict:
    """The median and the largest same-tile ratio over the rows (see same_tile_ratio)."""
    ratios = sorted(r["ours_vs_same_tile"] for r in rows if r.get("ours_vs_same_tile"))
    if not ratios:
        return {"median_ours_vs_same_tile": None, "max_ours_vs_same_tile": None}
    return {"median_ours_vs_same_tile": ratios[len(ratios) // 2], "max_ours_vs_same_tile": ratios[-1]}


def deepgemm_summary(rows) -> dict:
    """geomean_vs_deepgemm, min_vs_deepgemm over the rows timed against DeepGEMM, all_deepgemm_bitexact over the
    rows that compared bits; None where no row has the field (DeepGEMM absent)."""
    sp = [r["speedup_vs_deepgemm"] for r in rows if r.get("speedup_vs_deepgemm")]
    bits = [r["deepgemm_bitexact"] for r in rows if "deepgemm_bitexact" in r]
    return {"geomean_vs_deepgemm": geomean(sp) if sp else None, "min_vs_deepgemm": min(sp) if sp else None,
            "all_deepgemm_bitexact": all(b is True for b in bits) if bits else None}


def plot(rows, png, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"G{r['G']} M{r['M'] // 1024}k\nN{r['N']} K{r['K']}\n{r['dist']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, 0.55 * len(rows)), 5))
    xs = range(len(rows))
    bars = [("padded_path", "vs padded path"), ("padded_gemm", "vs padded GEMM alone")]
    if any("speedup_vs_deepgemm" in r for r in rows):
        bars.append(("deepgemm", "vs DeepGEMM (padded layout, padding not timed)"))
    width = 0.8 / len(bars)
    for j, (base, label) in enumerate(bars):
        ax.bar([x + (j - (len(bars) - 1) / 2) * width for x in xs], [r.get(f"speedup_vs_{base}", 0) for r in rows],
               width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("speedup of ours (x)")
    ax.set_title(f"Unpadded M-grouped FP8 GEMM on {common.gpu_label()} (higher is better)")
    ax.legend()
    common.save_figure(fig, png, out_dir)


def print_table(rows, summary):
    dg = any("deepgemm_ms" in r or "deepgemm_bitexact" in r or "deepgemm_error" in r for r in rows)
    cols = ["ours", "ours_m128", "ours_m192", "ours_bn192", "ours_bn256", "padded_path", "padded_gemm", "torch_rowwise", "bf16", "dense_cublas"]
    cols += ["deepgemm"] if dg else []
    print("\nTFLOPS (useful FLOPs 2*M*N*K), median of CUDA-event timings with L2 flush")
    print(f"{'G':>3} {'M':>6} {'N':>5} {'K':>5} {'dist':>8} {'pad%':>5} " + " ".join(f"{c:>13}" for c in cols) + "  xpad"
          + ("   x_dg dg_exact" if dg else "") + "  exact")
    for r in rows:
        vals = " ".join(f"{r.get(c + '_tflops', float('nan')):13.1f}" for c in cols)
        print(f"{r['G']:>3} {r['M']:>6} {r['N']:>5} {r['K']:>5} {r['dist']:>8} {r['pad_rows_pct']:5.1f} {vals}"
              f"  {r.get('speedup_vs_padded_path', float('nan')):.3f}"
              + (f" {r.get('speedup_vs_deepgemm', float('nan')):6.3f} {r.get('deepgemm_bitexact', '-')!s:>8}"
                 if dg else "") + f"  {r['bitexact']}")
    print("summary:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})


if __name__ == "__main__":
    main()
