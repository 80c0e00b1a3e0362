"""What is alive at the peak of one expert-MLP training step, ours against the BF16 twin (issue 54's layer rows): the
CUDA caching allocator's own trace (torch.cuda.memory._record_memory_history) of one step, replayed to find the
step's peak, and every block alive there named by the package's (or the benchmark's) frame that allocated it.

    python lab/probe_layer_memory.py [--model qwen3_30b_a3b] [--G 32] [--M 8192] [--release-bf16-weights]
                                     [--handed-inputs] [--json OUT.json]

Each method's step is `bench_mlp_layer.Step` (fresh gradients, weights re-quantized, or with
--release-bf16-weights written from FP32 masters at the step's start, outside the trace). --handed-inputs: x and dy
reach the layer as in a model (x made by the op before, y read by the op after and dropped, dY made by autograd), so
that a layer which saves x pays for it (the `handed` step of bench_mlp_layer's layer peak).
"""
import argparse
import collections
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import bench_mlp_layer as bml  # noqa: E402

from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP  # noqa: E402


def site(frames):
    """The innermost frame of this repository's Python (package, benchmark or lab) that led to an allocation."""
    for f in frames:
        name = f.get("filename", "")
        # (not the wheels lab/device_call.sh installs under the repository's .site)
        if name.startswith(ROOT + os.sep) and not name.startswith(os.path.join(ROOT, ".site")) \
                and "probe_layer_memory" not in name:
            return f"{os.path.relpath(name, ROOT)}:{f.get('line')} {f.get('name')}"
    return "(outside the repository)"


def replay(trace):
    """(peak bytes above the trace's start, the blocks allocated in the trace and alive at the peak as (size, site), the
    site of the allocation that made the peak) from one device's trace of alloc / free_completed actions. A block
    allocated before the trace and freed in it lowers the count (the step's reset frees the old FP8 copies before
    writing new ones); it has no site to name."""
    live, cur, peak, at_peak, peak_site = {}, 0, -1, [], None
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])))
            cur += e["size"]
            if cur > peak:
                peak, at_peak, peak_site = cur, list(live.values()), live[e["addr"]][1]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            cur -= e["size"]
    return peak, at_peak, peak_site


def traced_step(step, handed):
    """Trace one call of `step` (after its reset, outside the trace); the replayed peak."""
    step.reset()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=200000)
    step(handed=handed)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    return replay(trace)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_30b_a3b", choices=sorted(bml.MODELS))
    ap.add_argument("--G", type=int, default=32)
    ap.add_argument("--M", type=int, default=8192)
    ap.add_argument("--release-bf16-weights", action="store_true")
    ap.add_argument("--handed-inputs", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    H, F, sizes, x, probs, dy = bml.layer_inputs(args.model, args.G, args.M, "paper", 0)
    release = args.release_bf16_weights
    modules = {"ours": GroupedFP8MLP(args.G, H, F, "swiglu", device=bml.DEV, release_bf16_weights=release),
               "bf16": GroupedBF16MLP(args.G, H, F, "swiglu", device=bml.DEV)}
    modules["bf16"].load_state_dict(modules["ours"].state_dict())
    groups = sizes.to(bml.DEV)
    report = {"model": args.model, "G": args.G, "M": args.M, "H": H, "F": F, "release_bf16_weights": release,
              "handed_inputs": args.handed_inputs, "methods": {}}
    for name, module in modules.items():
        step = bml.Step(module, x, groups, probs, dy, requantize=True, optimizer_write=release)
        for _ in range(2):
            step(handed=args.handed_inputs)
        peak, blocks, peak_site = traced_step(step, args.handed_inputs)
        by_site = collections.Counter()
        for size, where in blocks:
            by_site[where] += size
        rows = sorted(by_site.items(), key=lambda kv: -kv[1])
        report["methods"][name] = {"peak_mb": round(peak / 2**20, 1), "peak_made_by": peak_site,
                                   "alive_at_peak_mb": {k: round(v / 2**20, 1) for k, v in rows}}
        print(f"\n{name}: step peak {peak / 2**20:.1f} MB (above the memory before the step), reached by {peak_site}")
        for where, size in rows:
            print(f"  {size / 2**20:9.1f} MB  {where}")
        del step
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
