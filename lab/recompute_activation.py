"""What Megatron's `moe_act` recompute costs and saves in the FP8 expert MLP (`GroupedFP8MLP(recompute_activation=
True)`, megatron_tma.activation_linear), on the six layer rows with Transformer Engine numbers (issue 5).

For each row (bench_mlp_layer.py's model, G, M, paper sizes and seed), in one process, the layer that keeps the
activation's FP8 columns (`keep`) and the one that recomputes them in backward (`recompute`):
* `<m>_ms`: the fwd + bwd step, weights re-quantized every step, timed in blocks as bench_mlp_layer.py does;
* `<m>_held_mb`: what the forward leaves allocated for backward (memory_allocated after the forward, minus before
  it and minus the output), with the FP8 weight copies already cached: the activation memory a layer holds from
  its forward to its backward, which is what adds up over the layers of a model;
* `<m>_peak_mb`: bench_mlp_layer.py's layer peak (what the layer holds plus one step with its inputs handed over;
  a one-layer number: recomputation allocates z again in backward, so this one can grow while the held memory
  shrinks);
* `bitexact`: every output and gradient equal between the two.

    python lab/recompute_activation.py [--iters 25] [--out FILE.json]   # writes FILE.png beside it
    python lab/recompute_activation.py --plot FILE.json                    # redraw the PNG (no GPU)
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_mlp_layer as bml  # noqa: E402
import common  # noqa: E402

from megatron_tma.mlp import GroupedFP8MLP  # noqa: E402

METHODS = ("keep", "recompute")


def held_mb(step: "bml.Step") -> float:
    """MB the forward leaves allocated (beyond its output) until the backward runs; weight copies cached."""
    step.reset()
    step.module(step.x, step.sizes, step.probs)  # fills the FP8 weight cache (outside the measurement)
    step.x.grad = step.probs.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out, _ = step.module(step.x, step.sizes, step.probs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.untyped_storage().nbytes()
    out.backward(step.dy)
    return held / 2**20


def run_row(model, G, M, seed, iters):
    dev = "cuda"
    H, F, sizes, x, probs, dy = bml.layer_inputs(model, G, M, "paper", seed, dev)
    keep = GroupedFP8MLP(G, H, F, "swiglu", device=dev)
    recompute = GroupedFP8MLP(G, H, F, "swiglu", device=dev, recompute_activation=True)
    recompute.load_state_dict(keep.state_dict())
    groups = sizes.to(dev)
    steps = {name: bml.Step(m, x, groups, probs, dy, requantize=True) for name, m in zip(METHODS, (keep, recompute))}
    row = {"model": model, "G": G, "M": M, "H": H, "F": F, "dist": "paper", "seed": seed}
    times = common.bench_blocks(steps, iters=iters)
    for name in METHODS:
        row[f"{name}_ms"] = round(times[name], 4)
        row[f"{name}_peak_mb"] = round(steps[name].peak_mb()[0], 1)
        row[f"{name}_held_mb"] = round(held_mb(steps[name]), 1)
    a = [t.clone() for t in steps["keep"].results()]
    row["bitexact"] = all(torch.equal(u, v) for u, v in zip(a, steps["recompute"].results()))
    row["held_saved_mb"] = round(row["keep_held_mb"] - row["recompute_held_mb"], 1)
    row["held_saved_pct"] = round(100.0 * row["held_saved_mb"] / row["keep_held_mb"], 2)
    row["time_cost_pct"] = round(100.0 * (row["recompute_ms"] / row["keep_ms"] - 1), 2)
    del steps, keep, recompute, a
    torch.cuda.empty_cache()
    return row


def plot(result: dict, png: str) -> None:
    """Held MB per layer (keep / recompute) and the step's time cost, per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model'].split('_')[0]}\nG={r['G']} M={r['M'] // 1024}k" for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for offset, method, color in ((-0.2, "keep", "tab:gray"), (0.2, "recompute", "tab:blue")):
        ax1.bar([x + offset for x in xs], [r[f"{method}_held_mb"] for r in rows], width=0.4, color=color,
                label={"keep": "keeps the activation's FP8 columns", "recompute": "recomputes them in backward"}[method])
    for x, r in zip(xs, rows):
        ax1.annotate(f"-{r['held_saved_pct']:.0f}%", (x + 0.2, r["recompute_held_mb"]), ha="center", va="bottom",
                     fontsize=8)
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_ylabel("MB held from forward to backward (one layer)")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.bar(list(xs), [r["time_cost_pct"] for r in rows], color="tab:orange")
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.set_xticks(list(xs), labels, fontsize=8)
    ax2.set_ylabel("step time, recompute vs keep (%)")
    fig.suptitle(f"moe_act recompute in the FP8 expert MLP (fwd + bwd, {result['gpu']}, {result['commit']}); "
                 f"all bits equal: {result['summary']['all_bitexact']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", metavar="RESULT_JSON", help="only redraw the PNG of a result")
    args = ap.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot[:-len(".json")] + ".png")
        return
    rows = []
    for model, G, M, seed in bml.te_rows():
        row = run_row(model, G, M, seed, args.iters)
        rows.append(row)
        print(f"{model:>14} G={G:3d} M={M:6d}: held {row['keep_held_mb']:.0f} -> {row['recompute_held_mb']:.0f} MB "
              f"(-{row['held_saved_pct']:.1f}%), peak {row['keep_peak_mb']:.0f} -> {row['recompute_peak_mb']:.0f} MB, "
              f"step {row['keep_ms']:.3f} -> {row['recompute_ms']:.3f} ms ({row['time_cost_pct']:+.1f}%), "
              f"bits {row['bitexact']}", flush=True)
    summary = {
        "all_bitexact": all(r["bitexact"] for r in rows),
        "held_saved_pct_min": min(r["held_saved_pct"] for r in rows),
        "held_saved_pct_max": max(r["held_saved_pct"] for r in rows),
        "time_cost_pct_geomean": round(100.0 * (bml.geomean([r["recompute_ms"] / r["keep_ms"] for r in rows]) - 1), 2),
    }
    print("summary:", summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "recompute_activation", "commit": common.git_commit(),
                       "gpu": torch.cuda.get_device_name(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python lab/recompute_activation.py", "rows": rows, "summary": summary},
                      f, indent=1)
        with open(args.out) as f:
            plot(json.load(f), args.out[:-len(".json")] + ".png")


if __name__ == "__main__":
    main()
