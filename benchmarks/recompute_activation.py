"""What Megatron's `moe_act` recompute costs and saves in the FP8 expert MLP (`GroupedFP8MLP(recompute_activation=
True)`, megatron_tma.activation_linear), on the six layer rows with Transformer Engine numbers (issue 5).

For each row (bench_mlp_layer.py's model, G, M, paper sizes and seed), in one process, the layer that keeps the
activation's FP8 columns (`keep`) and the one that recomputes them in backward (`recompute`):
* `<m>_ms`: the fwd + bwd step, weights re-quantized every step, timed in blocks as bench_mlp_layer.py does;
* `<m>_held_mb`: what the forward leaves allocated for backward (memory_allocated after the forward, minus before
  it and minus the output), with the FP8 weight copies already cached: the activation memory a layer holds from
  its forward to its backward, which is what adds up over the layers of a model;
* `<m>_peak_mb`: bench_mlp_layer.py's peak over one step (a one-layer number: recomputation allocates z again in
  backward, so this one can grow while the held memory shrinks);
* `bitexact`: every output and gradient equal between the two.

    python benchmarks/recompute_activation.py [--iters 25] [--out FILE.json]
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
        row[f"{name}_peak_mb"] = round(steps[name].peak_mb(), 1)
        row[f"{name}_held_mb"] = round(held_mb(steps[name]), 1)
    a = [t.clone() for t in steps["keep"].results()]
    row["bitexact"] = all(torch.equal(u, v) for u, v in zip(a, steps["recompute"].results()))
    row["held_saved_mb"] = round(row["keep_held_mb"] - row["recompute_held_mb"], 1)
    row["held_saved_pct"] = round(100.0 * row["held_saved_mb"] / row["keep_held_mb"], 2)
    row["time_cost_pct"] = round(100.0 * (row["recompute_ms"] / row["keep_ms"] - 1), 2)
    del steps, keep, recompute, a
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
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
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": "python benchmarks/recompute_activation.py", "rows": rows,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
