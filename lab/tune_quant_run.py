"""Run-length sweep of the per-group column quantizer (benchmarks/NOTES.md, quantization section).

The grouped quantizers hand each CTA runs of consecutive 128-token blocks; the launcher picks the run length
(min(8, tiles / (4 x resident CTAs))). MEGATRON_TMA_QUANT_RUN, read on every call, overrides it; this script
times each length on a few shapes, for two kinds of input: plain Gaussian rows, and the benchmark's rows
with per-row magnitudes 2^-8..2^8 (bench_quant.py); qt is [K, P], P = round_up(M, 128) + 128 G. Same timing protocol as the benchmarks (CUDA events, L2 flushed,
median). Prints TB/s of bytes read + written (the whole qt written); writes nothing.

    python lab/tune_quant_run.py [--runs 0,1,2,4,8,16] [--iters 20]      (run 0: the launcher's choice)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_quant import _rows_with_spread  # noqa: E402

from megatron_tma.groups import make_group_sizes, wgrad_pitch  # noqa: E402
from megatron_tma.quant import quantize_1x128_and_grouped_128x1, quantize_grouped_128x1  # noqa: E402

SHAPES = [(65536, 7168, 32, False), (65536, 4096, 8, False), (16384, 7168, 256, False),
          (65536, 7168, 32, True), (32768, 2048, 128, False), (8192, 2048, 32, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="0,1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    runs = [int(r) for r in args.runs.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'M':>6} {'K':>5} {'G':>4} {'kernel':7} {'input':8} " + " ".join(f"{'run=' + str(r):>8}" for r in runs))
    for m, k, G, fused in SHAPES:
        groups = make_group_sizes(m, G, "paper", seed=2000 + m + G).cuda()
        f = quantize_1x128_and_grouped_128x1 if fused else quantize_grouped_128x1
        nbytes = 2 * m * k + k * wgrad_pitch(m, G) + (m // 128 + G) * k * 4 + (m * k if fused else 0)
        for kind in ("gaussian", "spread"):
            x = (torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16) if kind == "gaussian"
                 else _rows_with_spread(m, k, gen))
            cells = []
            for r in runs:
                os.environ["MEGATRON_TMA_QUANT_RUN"] = str(r)
                ms = common.bench(lambda x=x: f(x, groups, False, backend="cuda"), iters=args.iters)
                cells.append(f"{nbytes / ms / 1e9:8.2f}")
            print(f"{m:>6} {k:>5} {G:>4} {'fused' if fused else 'columns':7} {kind:8} " + " ".join(cells), flush=True)
            os.environ.pop("MEGATRON_TMA_QUANT_RUN", None)
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
