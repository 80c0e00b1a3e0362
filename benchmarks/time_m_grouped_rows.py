"""`ours` alone on bench_m_grouped's five DESIGN rows (paper sizes, same seeds and inputs), one JSON line of
TFLOPS: the cheap timing that tune_ffma_hints.sh repeats, alternating builds across processes, to compare
builds whose effect is near the process-to-process spread (a few %).

    python benchmarks/time_m_grouped_rows.py [--iters 25] [--block-m 0|128|192] [--block-n 0|128|192|256]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_m_grouped import TABLE, make_inputs, row_seed  # noqa: E402

from megatron_tma.gemm import m_grouped_fp8_gemm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--block-m", type=int, default=0, help="tile height passed to the GEMM (0: its default)")
    ap.add_argument("--block-n", type=int, default=0, help="tile width passed to the GEMM (0: its default)")
    args = ap.parse_args()
    tflops = {}
    for i, (G, M, N, K) in enumerate(TABLE):
        _, groups, _, _, aq, a_s, wq, ws = make_inputs(G, M, N, K, "paper", row_seed(i))
        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        ms = common.bench(lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=args.block_m, block_n=args.block_n), iters=args.iters)
        tflops[f"G{G}_M{M}_N{N}_K{K}"] = round(2.0 * M * N * K / ms / 1e9, 1)
    print(json.dumps(tflops))


if __name__ == "__main__":
    main()
