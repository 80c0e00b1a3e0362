"""Drive the layer's two costliest quantizers on its own shapes, for ncu: the weights' 128x128 quantizer (with the
transposed copy) and the fused 1x128 rows + per-group columns quantizer of activations. Prints each call's time and
bytes per second (CUDA events, L2 flushed); with --profile it only runs each kernel three times, for a profiler:

    python lab/profile_quant.py [--weights 32,4096,7168] [--act 32768,7168,8]
    ncu --clock-control none --set full -k regex:quantize_128x128_kernel --launch-skip 1 --launch-count 1 \\
        python lab/profile_quant.py --profile     # (regex:quantize_grouped for the fused kernel)

--weights G,N,K (DeepSeek-V3-like fc1 of 32 local experts by default); --act M,K,G (paper sizes, seed 0).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_k_grouped import wgrad_pitch  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.groups import make_group_sizes  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="32,4096,7168")
    ap.add_argument("--act", default="32768,7168,8")
    ap.add_argument("--profile", action="store_true", help="no timing: each kernel three times, for ncu")
    args = ap.parse_args()
    g, n, k = (int(v) for v in args.weights.split(","))
    m, ka, ga = (int(v) for v in args.act.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(g, n, k, generator=gen, device="cuda") * 0.02).bfloat16()
    x = torch.randn(m, ka, generator=gen, device="cuda").bfloat16()
    sizes = make_group_sizes(m, ga, "paper", 0).to("cuda", torch.int32)
    calls = {
        f"quantize_128x128 [{g}, {n}, {k}]": (lambda: quant.quantize_128x128(w), 4 * w.numel()),
        f"quantize_1x128_and_grouped_128x1 [{m}, {ka}] G={ga}":
            (lambda: quant.quantize_1x128_and_grouped_128x1(x, sizes, num_groups=ga),
             3 * x.numel() + ka * wgrad_pitch(m, ga)),  # x read, q [M, K] and qt [K, P] written
    }
    if args.profile:
        for fn, _ in calls.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return
    times = common.bench_interleaved({name: fn for name, (fn, _) in calls.items()}, iters=20)
    for name, (_, nbytes) in calls.items():
        print(f"{name}: {times[name]:.3f} ms, {nbytes / times[name] / 1e9:.2f} TB/s (bytes read + written, "
              "scales not counted)")


if __name__ == "__main__":
    main()
