"""FP8 quantizer benchmark (docs/design.md §5 protocol): bandwidth of the three CUDA quantizers against the
device-to-device copy measured in the same run, every result checked bit for bit against
megatron_tma.reference on the same input. Writes benchmarks/results/quant-<stamp>.json and a PNG.
The MoE permutation's two kernels (megatron_tma.permutation) ride along: the fused quantizer reading its rows through
a top-k permutation of the tokens (against index_select + the fused quantizer), and combine_rows (against the torch
un-permutation Megatron runs without fusion: a BF16 index_add), on a DeepSeek-V3-like layer (T = 32768, top-8).

    python benchmarks/bench_quant.py [--quick] [--iters N] [--out DIR]

tbps = (bytes read + bytes written, padding and scales included) / median time; copy_ratio = tbps / copy_tbps.
The column quantizers write the whole wgrad operand qt [K, P], P = round_up(M, 128) + 128 G (docs/design.md §4: every
group starts at a multiple of 128 tokens, the columns between groups and the tail are written as zeros).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_k_grouped import wgrad_pitch  # noqa: E402

from megatron_tma import reference  # noqa: E402
from megatron_tma.groups import check_groups, make_group_sizes  # noqa: E402
from megatron_tma.permutation import combine_rows, permutation_from_routing_map  # noqa: E402
from megatron_tma.quant import (  # noqa: E402
    quantize_1x128,
    quantize_1x128_and_grouped_128x1,
    quantize_128x128,
    quantize_grouped_128x1,
    run_1x128_and_grouped_128x1,
    run_gather_1x128_and_grouped_128x1,
)

# Targets of the task (TB/s of bytes read + written at the headline shapes, bf16, FP32 scales).
TARGETS = {("quantize_1x128", "65536x7168"): 2.8, ("quantize_128x128", "32x4096x7168"): 2.4,
           ("quantize_grouped_128x1", "65536x7168"): 2.4}

# (kernel, shape, extra) -- the headline shapes first.
CONFIGS = [
    ("quantize_1x128", (65536, 7168), {}),
    ("quantize_128x128", (32, 4096, 7168), {}),
    ("quantize_grouped_128x1", (65536, 7168), {"G": 32, "dist": "paper"}),
    ("quantize_1x128", (65536, 7168), {"pow2": True}),
    ("quantize_1x128", (16384, 4096), {}),
    ("quantize_1x128", (65536, 2048), {}),
    ("quantize_128x128", (8, 7168, 4096), {}),
    ("quantize_128x128", (32, 2048, 7168), {"pow2": True}),
    ("quantize_grouped_128x1", (65536, 7168), {"G": 32, "dist": "skewed"}),
    ("quantize_grouped_128x1", (65536, 4096), {"G": 8, "dist": "paper"}),
    ("quantize_grouped_128x1", (16384, 7168), {"G": 256, "dist": "with_empty"}),
    ("quantize_grouped_128x1", (65536, 7168), {"G": 32, "dist": "paper", "pow2": True}),
    ("quantize_1x128_and_grouped_128x1", (65536, 7168), {"G": 32, "dist": "paper"}),
    ("quantize_1x128_and_grouped_128x1", (32768, 4096), {"G": 8, "dist": "skewed"}),
    # (tokens T, hidden K); the rows are the T topk permuted ones of a random top-k routing over G experts
    ("gather_quantize_1x128_and_grouped_128x1", (32768, 2048), {"G": 64, "topk": 8}),
    ("combine_rows", (32768, 2048), {"G": 64, "topk": 8}),
]
QUICK = CONFIGS[:3]
# The result rows name each kernel by its role too, so that readers (and target checks) can
# tell the wgrad column quantizer from the 1x128 row quantizer; "op" keeps the Python function name.
KERNEL_LABEL = {"quantize_grouped_128x1": "quantize_grouped_128x1 (wgrad columns)",
                "quantize_1x128_and_grouped_128x1": "quantize_1x128_and_grouped_128x1 (fused rows + wgrad columns)",
                "gather_quantize_1x128_and_grouped_128x1": "rows + columns, rows permuted",
                "combine_rows": "combine_rows (FP32 un-permute)"}


def _cdiv(a, b):
    return -(-a // b)


def _rows_with_spread(rows, cols, gen):
    """Gaussian rows with per-row magnitudes 2^-8..2^8 (bf16), generated on the GPU."""
    x = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16)
    x *= torch.exp2(torch.randint(-8, 9, (rows, 1), generator=gen, device="cuda").to(torch.bfloat16))
    return x


def _same(out, ref):
    """Bit equality of every output (fp8 as bytes), layouts included."""
    for o, r in zip(out, ref):
        if o.shape != r.shape:
            return False
        if o.dtype == torch.float8_e4m3fn:
            o, r = o.view(torch.uint8), r.view(torch.uint8)
        if not torch.equal(o, r):
            return False
    return True


def _routed(tokens, experts, topk, gen):
    """A random top-k routing's permutation (megatron_tma.permutation) and its tokens per expert, on the GPU."""
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    chosen = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)
    perm, sizes, _ = permutation_from_routing_map(routing_map, topk)
    return perm, sizes


def _permutation_config(kernel, shape, extra, gen, pow2, row, iters):
    """(fn, ref, bytes moved) of the two permutation kernels; row gets the baseline's time."""
    tokens, k = shape
    G, topk = extra["G"], extra["topk"]
    m = tokens * topk
    row.update(G=G, topk=topk, rows=m)
    perm, sizes = _routed(tokens, G, topk, gen)
    if kernel == "gather_quantize_1x128_and_grouped_128x1":
        x = _rows_with_spread(tokens, k, gen)
        groups = check_groups(sizes, G, m_total=m)
        fn = lambda: run_gather_1x128_and_grouped_128x1(x, perm.rows, groups, pow2, "cuda")  # noqa: E731
        ref = lambda: run_1x128_and_grouped_128x1(x.index_select(0, perm.rows), groups, pow2, "cuda")  # noqa: E731
        nbytes = (2 * m * k + m * 4 + m * k + _cdiv(k, 128) * _cdiv(m, 4) * 4 * 4 + k * wgrad_pitch(m, G)
                  + (m // 128 + G) * k * 4)  # the gathered rows read once, and what the fused quantizer writes
        row["baseline"] = "index_select (the permuted BF16 copy) + the fused quantizer"
        row["baseline_ms"] = round(common.bench(ref, iters=iters), 5)
        return fn, ref, nbytes
    y = _rows_with_spread(m, k, gen)
    fn = lambda: (combine_rows(y, perm, backend="cuda"),)  # noqa: E731
    ref = lambda: (combine_rows(y, perm, backend="reference"),)  # noqa: E731
    token_of_row = perm.rows.long()
    row["baseline"] = "BF16 index_add of the rows into zeroed tokens (Megatron's unfused un-permutation)"
    row["baseline_ms"] = round(common.bench(
        lambda: torch.zeros(tokens, k, dtype=y.dtype, device="cuda").index_add_(0, token_of_row, y), iters=iters), 5)
    return fn, ref, 2 * m * k + tokens * topk * 4 + 2 * tokens * k  # y and the plan read, the tokens written


def run_config(kernel, shape, extra, seed, iters):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pow2 = extra.get("pow2", False)
    row = {"kernel": KERNEL_LABEL.get(kernel, kernel), "op": kernel, "shape": "x".join(map(str, shape)), "dtype": "bfloat16", "pow2": pow2}
    if kernel in ("gather_quantize_1x128_and_grouped_128x1", "combine_rows"):
        fn, ref, nbytes = _permutation_config(kernel, shape, extra, gen, pow2, row, iters)
    elif kernel == "quantize_1x128":
        m, k = shape
        x = _rows_with_spread(m, k, gen)
        fn = lambda: quantize_1x128(x, pow2, backend="cuda")  # noqa: E731
        ref = lambda: reference.quantize_1x128(x, pow2)  # noqa: E731
        nbytes = 2 * m * k + m * k + _cdiv(k, 128) * _cdiv(m, 4) * 4 * 4
    elif kernel == "quantize_128x128":
        g, n, k = shape
        w = _rows_with_spread(g * n, k, gen).view(g, n, k)
        fn = lambda: quantize_128x128(w, pow2, backend="cuda")  # noqa: E731
        ref = lambda: reference.quantize_128x128(w, pow2)  # noqa: E731
        nbytes = 2 * g * n * k + 2 * g * n * k + 2 * g * _cdiv(n, 128) * _cdiv(k, 128) * 4
    else:
        m, k = shape
        G, dist = extra["G"], extra["dist"]
        row.update(G=G, dist=dist)
        x = _rows_with_spread(m, k, gen)
        groups = make_group_sizes(m, G, dist, seed).cuda()
        nbytes = 2 * m * k + k * wgrad_pitch(m, G) + (m // 128 + G) * k * 4  # x read; qt [K, P] and scales written
        if kernel == "quantize_grouped_128x1":
            fn = lambda: quantize_grouped_128x1(x, groups, pow2, backend="cuda")  # noqa: E731
            ref = lambda: reference.quantize_grouped_128x1(x, groups, pow2)  # noqa: E731
        else:  # fused: the 1x128 outputs on top, x read once
            fn = lambda: quantize_1x128_and_grouped_128x1(x, groups, pow2, backend="cuda")  # noqa: E731
            ref = lambda: reference.quantize_1x128(x, pow2) + reference.quantize_grouped_128x1(x, groups, pow2)  # noqa: E731
            nbytes += m * k + _cdiv(k, 128) * _cdiv(m, 4) * 4 * 4
            separate = common.bench(lambda: (quantize_1x128(x, pow2, backend="cuda"),
                                             quantize_grouped_128x1(x, groups, pow2, backend="cuda")), iters=iters)
            row["separate_ms"] = round(separate, 5)
    ms = common.bench(fn, iters=iters)
    row["ms"] = round(ms, 5)
    row["bytes"] = nbytes
    row["tbps"] = round(nbytes / (ms * 1e-3) / 1e12, 3)
    row["bitexact"] = _same(fn(), ref())
    if "separate_ms" in row:
        row["speedup_vs_separate"] = round(row["separate_ms"] / ms, 3)
    if "baseline_ms" in row:
        row["speedup_vs_baseline"] = round(row["baseline_ms"] / ms, 3)
    target = TARGETS.get((kernel, row["shape"])) if not pow2 and extra.get("dist", "paper") == "paper" else None
    if target is not None:
        row["target_tbps"] = target
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the three headline shapes only")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default=None, help="also copy the JSON and PNG here")
    args = ap.parse_args()
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    configs = QUICK if args.quick else CONFIGS
    rows = []
    for i, (kernel, shape, extra) in enumerate(configs):
        row = run_config(kernel, shape, extra, seed=2000 + i, iters=args.iters)
        row["copy_ratio"] = round(row["tbps"] / ceilings["copy_tbps"], 3)
        if "target_tbps" in row:
            row["meets_target"] = row["tbps"] >= row["target_tbps"]
        rows.append(row)
        print(f"[{i + 1}/{len(configs)}] {kernel} {row['shape']}: {row['tbps']} TB/s "
              f"({row['copy_ratio']:.2f} of copy), bitexact={row['bitexact']}", flush=True)
        torch.cuda.empty_cache()
    summary = {
        "all_bitexact": all(r["bitexact"] for r in rows),
        "all_targets_met": all(r.get("meets_target", True) for r in rows),
    }
    command = "python benchmarks/bench_quant.py" + (" --quick" if args.quick else "")
    path = common.write_result("quant", rows, ceilings, command=command, extra={"summary": summary}, out_dir=args.out)
    plot(rows, ceilings, path.replace(".json", ".png"), args.out)
    print_table(rows, ceilings, summary)
    print(f"wrote {path}")


def _groups(r):
    if "topk" in r:
        return f"G{r['G']} top{r['topk']}"
    return f"G{r['G']} {r['dist']}" if "G" in r else ""


def _label(r):
    extra = f" {_groups(r)}" if "G" in r else ""
    name = r["op"].replace("quantize_", "").replace("_and_", "+")
    return f"{name}\n{r['shape']}{extra}" + ("\npow2" if r["pow2"] else "")


def plot(rows, ceilings, png, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(9, 0.8 * len(rows)), 5))
    xs = list(range(len(rows)))
    colors = {"quantize_1x128": "tab:blue", "quantize_128x128": "tab:orange", "quantize_grouped_128x1": "tab:green",
              "quantize_1x128_and_grouped_128x1": "tab:purple", "gather_quantize_1x128_and_grouped_128x1": "tab:pink",
              "combine_rows": "tab:gray"}
    ax.bar(xs, [r["tbps"] for r in rows], 0.6, color=[colors[r["op"]] for r in rows])
    for x, r in zip(xs, rows):
        if "target_tbps" in r:
            ax.hlines(r["target_tbps"], x - 0.3, x + 0.3, colors="red", lw=2)
    ax.axhline(ceilings["copy_tbps"], color="k", ls="--", lw=1, label=f"device copy {ceilings['copy_tbps']} TB/s")
    ax.set_xticks(xs)
    ax.set_xticklabels([_label(r) for r in rows], fontsize=6)
    ax.set_ylabel("TB/s (bytes read + written)")
    ax.set_title(f"FP8 quantizers on {common.gpu_label()}, bf16 in (red: target)")
    ax.legend()
    common.save_figure(fig, png, out_dir)


def print_table(rows, ceilings, summary):
    print(f"\nTB/s of bytes read + written (median of CUDA-event timings with L2 flush); copy {ceilings['copy_tbps']} TB/s")
    print(f"{'kernel':<34} {'shape':<14} {'groups':<14} {'pow2':>5} {'ms':>9} {'TB/s':>6} {'xcopy':>6} {'target':>6} "
          f"{'exact':>6}  note")
    for r in rows:
        grp = _groups(r)
        tgt = f"{r['target_tbps']:.1f}" if "target_tbps" in r else ""
        note = f"x{r['speedup_vs_separate']} vs two calls ({r['separate_ms']:.4f} ms)" if "separate_ms" in r else ""
        if "baseline_ms" in r:
            note = f"x{r['speedup_vs_baseline']} vs {r['baseline']} ({r['baseline_ms']:.4f} ms)"
        print(f"{r['kernel']:<34} {r['shape']:<14} {grp:<14} {str(r['pow2']):>5} {r['ms']:9.4f} {r['tbps']:6.3f} "
              f"{r['copy_ratio']:6.3f} {tgt:>6} {str(r['bitexact']):>6}  {note}")
    print("summary:", summary)


if __name__ == "__main__":
    main()
