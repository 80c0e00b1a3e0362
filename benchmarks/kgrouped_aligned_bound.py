"""What the K-grouped (wgrad) GEMM could reach if every group started on an aligned token: a measured bound for
the DESIGN.md §4 layout question of issue 4 (benchmarks/NOTES.md, K-grouped section, item 5).

Our K-grouped kernel realigns every 128-token block in shared memory because a group may start at any token of
`qt` and TMA cannot start a box off a 16-byte boundary. Without that constraint, dW_g = dY_g^T . X_g over
aligned token blocks is an ordinary FP8 GEMM per group with the tokens as the contraction, i.e. exactly what the
M-grouped kernel computes when its groups are the G weight-gradient matrices: A = the stacked dY_g^T
[G*N, T] (groups of N rows), B = X_g^T [G, K, T], contraction T = tokens per group. This script times that
M-grouped call (default tile, BF16 out) on the K-grouped benchmark's shapes with balanced groups of T = M/G
tokens rounded to 128, next to our K-grouped kernel on the same token counts (BF16 out, and FP32 accumulate as
the K-grouped benchmark times it), all against the K-grouped benchmark's roofline measured in the same run.

It is a bound, not the kernel: the M-grouped promotion multiplies by one row scale and one block scale, where
wgrad needs a row x column scale product per element (one more multiply per element and block), and it writes
BF16 where Megatron's main_grad path reads and writes FP32. Both make a real aligned kernel slower than this.

Also timed: `aligned_kernel`, the experimental K-grouped kernel for 16-aligned group starts
(kernels/k_grouped_aligned_fp8_gemm.cuh, MEGATRON_TMA_KGROUPED_ALIGNED16=1, BF16 out), with its bits checked
against ours.

    python benchmarks/kgrouped_aligned_bound.py [--iters 20] [--out FILE.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_k_grouped import roofline_ms  # noqa: E402  (the K-grouped benchmark's own roofline)
from bench_m_grouped import MORE, TABLE  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm  # noqa: E402

ALIGNED_ENV = "MEGATRON_TMA_KGROUPED_ALIGNED16"  # the experimental aligned-start kernel (BF16 out)


def aligned16(fn):
    """`fn` as a callable that runs with the experimental aligned-start K-grouped kernel switched on (the launcher
    reads ALIGNED_ENV on every call). Only for groups that start on 16-token boundaries: nothing checks it."""
    def call():
        os.environ[ALIGNED_ENV] = "1"
        try:
            return fn()
        finally:
            del os.environ[ALIGNED_ENV]
    return call


def run_row(G, M, N, K, ceilings, iters, seed):
    dev = "cuda"
    T = max(128, round(M / G / 128) * 128)  # balanced, aligned tokens per group
    Mt = G * T
    gen = torch.Generator(device=dev).manual_seed(seed)
    row = {"G": G, "M": M, "N": N, "K": K, "tokens_per_group": T, "M_used": Mt,
           "roofline_ms": round(roofline_ms(G, Mt, N, K, ceilings), 5)}
    # The bound: M-grouped, groups of N rows (dY_g^T), contraction over the group's T tokens.
    a, a_s = quant.quantize_1x128(torch.randn(G * N, T, generator=gen, device=dev).bfloat16())
    b, b_s, _, _ = quant.quantize_128x128(torch.randn(G, K, T, generator=gen, device=dev).bfloat16())
    rows_per_group = torch.full((G,), N, dtype=torch.int32, device=dev)
    out_m = torch.empty(G * N, K, dtype=torch.bfloat16, device=dev)
    # Ours on the same token counts: token-contiguous operands as the column quantizer writes them.
    sizes = torch.full((G,), T, dtype=torch.int32, device=dev)
    x = torch.randn(Mt, K, generator=gen, device=dev).bfloat16()
    dy = torch.randn(Mt, N, generator=gen, device=dev).bfloat16()
    xt, xs = quant.quantize_grouped_128x1(x, sizes)
    dyt, dys = quant.quantize_grouped_128x1(dy, sizes)
    out_k = torch.empty(G, N, K, dtype=torch.bfloat16, device=dev)
    main_grad = torch.zeros(G, N, K, device=dev)
    out_a = torch.empty(G, N, K, dtype=torch.bfloat16, device=dev)

    # the experimental kernel for 16-aligned group starts (these groups start 128-aligned)
    aligned_kernel = aligned16(lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=out_a))

    fns = {
        "aligned_bound": lambda: m_grouped_fp8_gemm(a, a_s, b, b_s, rows_per_group, out=out_m),
        "aligned_kernel": aligned_kernel,
        "ours_bf16": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=out_k),
        "ours_fp32_acc": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=main_grad, accumulate=True),
    }
    common.time_methods(row, fns, 2.0 * Mt * N * K, iters)
    for name in fns:
        row[f"{name}_over_roofline"] = round(row[f"{name}_ms"] / row["roofline_ms"], 3)
    row["ours_bf16_over_bound"] = round(row["ours_bf16_ms"] / row["aligned_bound_ms"], 3)
    row["aligned_kernel_bitexact"] = bool(torch.equal(aligned_kernel(), k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes,
                                                                                           out_dtype=torch.bfloat16)))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    for i, (G, M, N, K) in enumerate(TABLE + MORE):
        row = run_row(G, M, N, K, ceilings, args.iters, 4000 + i)
        rows.append(row)
        print(f"G={G:3d} M={M:6d} N={N:5d} K={K:5d} T={row['tokens_per_group']:5d} roofline {row['roofline_ms']:.3f} ms | "
              f"aligned bound {row['aligned_bound_ms']:.3f} ({row['aligned_bound_over_roofline']:.2f}x) | aligned kernel "
              f"{row['aligned_kernel_ms']:.3f} ({row['aligned_kernel_over_roofline']:.2f}x, bits "
              f"{'=' if row['aligned_kernel_bitexact'] else 'DIFFER'}) | ours bf16 "
              f"{row['ours_bf16_ms']:.3f} ({row['ours_bf16_over_roofline']:.2f}x) | ours fp32+= {row['ours_fp32_acc_ms']:.3f} "
              f"({row['ours_fp32_acc_over_roofline']:.2f}x) | ours/bound x{row['ours_bf16_over_bound']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "kgrouped_aligned_bound", "commit": common.git_commit(),
                       "gpu": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
