"""`ours` alone on bench_m_grouped's five reference rows of docs/design.md §5 (paper sizes, same seeds and inputs), one JSON line of
TFLOPS: the cheap timing that tune_ffma_hints.sh repeats, alternating builds across processes, to compare
builds whose effect is near the process-to-process spread (a few %).

    python lab/time_m_grouped_rows.py [--iters 25] [--block-m 0|128|192] [--block-n 0|128|192|256]
    python lab/time_m_grouped_rows.py --grid-rows 0,6,7 --padded-gemm [--repeat 3]
    ncu ... python lab/time_m_grouped_rows.py --grid-rows 9 --padded-gemm --profile-calls 2

--grid-rows times rows of the full grid instead (indices as bench_m_grouped numbers them, with their size
distribution and seed); --padded-gemm also times the GEMM alone on the same rows padded to 128 per group, the
two alternating, for the "ours against the padded GEMM" target where one grid run is too noisy to tell.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_m_grouped import DISTS, MORE, TABLE, make_inputs, row_seed  # noqa: E402

from megatron_tma.gemm import m_grouped_fp8_gemm  # noqa: E402
from megatron_tma.padding import pad_rows_fp8  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--block-m", type=int, default=0, help="tile height passed to the GEMM (0: its default)")
    ap.add_argument("--block-n", type=int, default=0, help="tile width passed to the GEMM (0: its default)")
    ap.add_argument("--grid-rows", default="", help="comma-separated row indices of the full grid (default: the "
                    "five reference rows of docs/design.md §5, paper sizes)")
    ap.add_argument("--padded-gemm", action="store_true", help="also time the GEMM alone on 128-padded groups")
    ap.add_argument("--repeat", type=int, default=1, help="timings per method and row, alternating")
    ap.add_argument("--profile-calls", type=int, default=0, help="no timing: call each method this many times per "
                    "row (ours first), for ncu to profile the same data: `ncu --kernel-name regex:m_grouped "
                    "--launch-count 4 ... --grid-rows 9 --padded-gemm --profile-calls 2`")
    args = ap.parse_args()
    if args.grid_rows:
        grid = [(c, d) for c in TABLE + MORE for d in DISTS]
        rows = [(int(i), grid[int(i)]) for i in args.grid_rows.split(",")]
    else:
        rows = [(i, (c, "paper")) for i, c in enumerate(TABLE)]
    result = {}
    for i, ((G, M, N, K), dist) in rows:
        _, groups, _, _, aq, a_s, wq, ws = make_inputs(G, M, N, K, dist, row_seed(i))
        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        fns = {"ours": lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=args.block_m,
                                                  block_n=args.block_n)}
        if args.padded_gemm:
            a_pad, a_s_pad, pad_off = pad_rows_fp8(aq, a_s, groups, 128, num_groups=G)
            fns["padded_gemm"] = lambda: m_grouped_fp8_gemm(a_pad, a_s_pad, wq, ws, pad_off)
        if args.profile_calls:
            for name, fn in fns.items():
                for _ in range(args.profile_calls):
                    fn()
            torch.cuda.synchronize()
            continue
        times = {name: [] for name in fns}
        for _ in range(args.repeat):
            for name, fn in fns.items():
                times[name].append(common.bench(fn, iters=args.iters))
        key = f"G{G}_M{M}_N{N}_K{K}" + (f"_{dist}" if args.grid_rows else "")
        tflops = {name: round(2.0 * M * N * K / statistics.median(t) / 1e9, 1) for name, t in times.items()}
        result[key] = tflops["ours"] if len(tflops) == 1 else tflops
    if not args.profile_calls:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
