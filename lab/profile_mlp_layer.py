"""Where one expert-MLP training step spends its time: the kernels of `ours` and `padded_path` (and `bf16`) side by
side, per step, from torch.profiler, next to the step's wall time on the GPU (CUDA events, L2 flushed, as the layer
benchmark) and the host time to enqueue it. Wall minus the kernel sum is time the GPU sat idle inside the step
(host-bound stretches, synchronisations). It answers "what should be made faster next" for
benchmarks/bench_mlp_layer.py, which builds the same step.

It also times the three steps round-robin, as the benchmark does, next to their times alone, and counts the
caching allocator's cudaMalloc / cudaFree calls per step in both settings: a step that has to grow the pool
(or empty it, which synchronises) spends host time the GPU waits for.

    python lab/profile_mlp_layer.py [--config mixtral:8:32768] [--steps 3] [--json FILE]

--config model:G:M (models of bench_mlp_layer.py; repeat the flag for several). Kernel names are shortened to
their function name; time is the sum over the profiled steps divided by the step count. Wall and host times of a
configuration are taken before it is profiled; a later configuration in the same process comes after the earlier
ones' profiling, so for host-bound rows run one configuration per process (compare host_ms_after_profiling).
"""
import argparse
import json
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_mlp_layer as bml  # noqa: E402
import common  # noqa: E402

from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP  # noqa: E402


def short_name(name):
    """'void megatron_tma::k_grouped_kernel<Cfg<4> >(Params)' -> 'k_grouped_kernel<Cfg<4> >'."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*\)$", "", name)
    name = re.sub(r"^(\w+::)+", "", name)
    return name[:90]


def kernel_times(step, steps):
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = evt.cuda_time_total
        if t > 0 and evt.key and not evt.key.startswith("ProfilerStep"):
            k = short_name(evt.key)
            times[k] = times.get(k, 0.0) + t / 1000.0 / steps
    return times


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_events(steps, rounds=6):
    """cudaMalloc / cudaFree calls (and allocation retries) per step of each named step, run round-robin."""
    counts = {name: dict.fromkeys(ALLOC_KEYS, 0) for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            before = torch.cuda.memory_stats()
            step()
            torch.cuda.synchronize()
            after = torch.cuda.memory_stats()
            for k in ALLOC_KEYS:
                counts[name][k] += after.get(k, 0) - before.get(k, 0)
    return {name: {k: v / rounds for k, v in c.items()} for name, c in counts.items()}


def top_cpu_ops(step, count=12):
    """The host-side ops that take the most self CPU time in one step (ms). The first profiled step of a session
    is discarded: the first CUDA call under the profiler carries its one-time set-up, which otherwise lands in the
    self time of whichever op comes first in the step."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]):  # discarded
        step()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:count]
    return {e.key[:60]: round(e.self_cpu_time_total / 1000.0, 3) for e in ops}


def profile_config(model, G, M, steps, seed=2010):
    H, F, sizes, x, probs, dy = bml.layer_inputs(model, G, M, "paper", seed)
    mods = {"ours": GroupedFP8MLP(G, H, F, "swiglu", device="cuda"),
            "padded_path": GroupedFP8MLP(G, H, F, "swiglu", pad_to=128, device="cuda"),
            "bf16": GroupedBF16MLP(G, H, F, "swiglu", device="cuda")}
    groups = sizes.cuda()
    kernels, timing = {}, {}
    step_fns = {name: bml.Step(mod, x, groups, probs, dy, requantize=True) for name, mod in mods.items()}
    # Timings first: after torch.profiler has run in a process, host-bound steps measured slower there than in
    # the benchmark (Qwen3 G=128: 6.6 vs 4.5 ms), so wall and host time are taken before any profiling and host
    # time once more after it (host_ms_after_profiling shows what profiling leaves behind).
    for name, step in step_fns.items():
        timing[name] = {"wall_ms": common.bench(step, iters=10, warmup=2), "host_ms": bml.host_ms(step, calls=10)}
        timing[name]["allocator_alone"] = allocator_events({name: step})[name]
    for name, ms in common.bench_interleaved(step_fns, iters=10, warmup=2).items():
        timing[name]["wall_ms_interleaved"] = ms
    # Each method timed round-robin with one other only: which neighbour moves a step's time?
    for name in step_fns:
        timing[name]["wall_ms_with"] = {}
    names = list(step_fns)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pair = common.bench_interleaved({a: step_fns[a], b: step_fns[b]}, iters=10, warmup=2)
            timing[a]["wall_ms_with"][b], timing[b]["wall_ms_with"][a] = pair[a], pair[b]
    for name, c in allocator_events(step_fns).items():
        timing[name]["allocator_interleaved"] = c
    for name, step in step_fns.items():
        kernels[name] = kernel_times(step, steps)
        timing[name]["kernel_ms"] = sum(kernels[name].values())
        if name == "ours":
            timing[name]["top_cpu_ops_ms"] = top_cpu_ops(step)
        timing[name]["host_ms_after_profiling"] = bml.host_ms(step, calls=10)
    del mods, step_fns
    torch.cuda.empty_cache()
    return {"kernels": kernels, "timing": timing}


def print_table(title, profile):
    result, timing = profile["kernels"], profile["timing"]
    names = sorted(set().union(*result.values()), key=lambda k: -max(r.get(k, 0.0) for r in result.values()))
    methods = list(result)
    print(f"\n{title}: GPU ms per fwd+bwd step, by kernel")
    print(f"{'kernel':92} " + " ".join(f"{m:>11}" for m in methods))
    for k in names:
        print(f"{k:92} " + " ".join(f"{result[m].get(k, 0.0):11.3f}" for m in methods))
    print(f"{'TOTAL (sum of kernel times)':92} " + " ".join(f"{sum(result[m].values()):11.3f}" for m in methods))
    for key, label in (("wall_ms", "step wall time (CUDA events, L2 flushed)"),
                       ("wall_ms_interleaved", "step wall time, the three steps timed round-robin"),
                       ("host_ms", "host time to enqueue the step"),
                       ("host_ms_after_profiling", "host time to enqueue the step, after torch.profiler ran")):
        print(f"{label:92} " + " ".join(f"{timing[m][key]:11.3f}" for m in methods))
    for other in methods:
        label = f"step wall time, timed round-robin with {other} only"
        print(f"{label:92} " + " ".join(f"{timing[m]['wall_ms_with'].get(other, float('nan')):11.3f}" for m in methods))
    for setting in ("alone", "interleaved"):
        for k in ALLOC_KEYS:
            label = f"allocator {k} per step ({setting})"
            print(f"{label:92} " + " ".join(f"{timing[m]['allocator_' + setting][k]:11.2f}" for m in methods))
    print(f"{'GPU idle inside the step (wall - kernel sum)':92} " +
          " ".join(f"{timing[m]['wall_ms'] - timing[m]['kernel_ms']:11.3f}" for m in methods))
    print("ours, top host ops by self CPU ms:", timing["ours"]["top_cpu_ops_ms"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help="model:G:M, e.g. mixtral:8:32768")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None,
                    help="write {config: {kernels: {method: {kernel: ms}}, timing: {method: {...}}}} here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_mlp_layer: needs a CUDA GPU")
    configs = args.config or ["mixtral:8:32768", "deepseek_v3:32:32768"]
    out = {}
    for c in configs:
        try:
            model, G, M = c.split(":")
            G, M = int(G), int(M)
        except ValueError:
            sys.exit(f"profile_mlp_layer: --config wants model:G:M, got {c!r}")
        if model not in bml.MODELS:
            sys.exit(f"profile_mlp_layer: unknown model {model!r}; one of {sorted(bml.MODELS)}")
        out[c] = profile_config(model, G, M, args.steps)
        print_table(c, out[c])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
