"""Host time of every package call inside one expert-MLP training step (ours), in call order.

torch.profiler puts 2.5 ms of host self time per step in `megatron_tma::quantize_128x128` (Qwen3-like G=128,
`lab/profile_mlp_layer.py`), where the call alone costs 15-60 us. This wraps each quantizer / GEMM /
activation entry point with a wall-clock timer, runs a few steps of the layer benchmark's step, and prints for the
last step: each call's host ms, whether the GPU stream was idle when it started, and the step's total host time.

    python lab/probe_step_host.py [--config qwen3_30b_a3b:128:32768] [--steps 4]
"""
import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_mlp_layer as bml  # noqa: E402

from megatron_tma import activation, autograd, gemm, quant  # noqa: E402
from megatron_tma.mlp import GroupedFP8MLP  # noqa: E402

RECORD = []


def timed(module, name):
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        idle = torch.cuda.current_stream().query()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        RECORD.append((f"{module.__name__.split('.')[-1]}.{name}", 1e3 * (time.perf_counter() - t0), idle))
        return out
    setattr(module, name, wrapper)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3_30b_a3b:128:32768")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    model, G, M = args.config.split(":")
    G, M = int(G), int(M)
    H, F, _ = bml.MODELS[model]
    for module in (quant, gemm, activation, autograd):
        for name in dir(module):
            if not name.startswith("_") and callable(getattr(module, name)) and getattr(
                    getattr(module, name), "__module__", "") == module.__name__ and not isinstance(getattr(module, name), type):
                timed(module, name)
    _, _, sizes, x, probs, dy = bml.layer_inputs(model, G, M, "paper", 2010)
    step = bml.Step(GroupedFP8MLP(G, H, F, "swiglu", device="cuda"), x, sizes.cuda(), probs, dy, requantize=True)
    for _ in range(args.steps):
        torch.cuda.synchronize()
        RECORD.clear()
        t0 = time.perf_counter()
        step()
        host = 1e3 * (time.perf_counter() - t0)
    print(f"{args.config}: host ms of the last step {host:.3f}; package calls (outermost and nested), in order:")
    for name, ms, idle in RECORD:
        print(f"  {name:45} {ms:8.3f} ms   GPU {'idle' if idle else 'busy'} at the call")
    print(f"  sum of recorded calls (nested ones count twice): {sum(ms for _, ms, _ in RECORD):.3f} ms")


if __name__ == "__main__":
    main()
