"""Lab probe (not part of the product): our K-grouped wgrad kernel against DeepGEMM 2.6.1's
k_grouped_fp8_gemm_nt_contiguous on the same FP8 operands and scales, FP32 accumulate into main_grad, plus ours with
BF16 out against BF16 torch._grouped_mm. One process, L2 flushed, CUDA events, median; bits compared with
torch.equal. DeepGEMM needs each group's tokens as a contiguous K-major [rows, round_up(M_g, 128)] block: with the
128-token group starts those blocks are exactly our columns [a_g, a_{g+1}), copied out (not timed).

    python lab/kgrouped_vs_deepgemm.py [--shapes G:M:N:K,...] [--dist paper] [--iters 20] [--json FILE]
"""
import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm  # noqa: E402
from megatron_tma.groups import aligned_token_offsets, make_group_sizes, token_block_offsets  # noqa: E402

ISSUE_SHAPES = "8:16384:4096:4096,16:32768:7168:4096,8:65536:6144:5120,32:16384:3072:8192,32:8192:4096:7168"


def deepgemm_operands(qt, s, a, used):
    """Our [rows, P] operand and [MB, rows] scales -> DeepGEMM's flat per-group K-major blocks and [rows, blocks]."""
    flat = torch.cat([qt[:, a[g]: a[g + 1]].reshape(-1) for g in range(len(a) - 1)])
    return flat, s[:used].t()


def wgrad_operands(G, M, N, K, dist):
    """One shape's wgrad operands, ours and DeepGEMM's views of the same FP8 bytes and scales (fixed seeds): the BF16
    x [M, K] and dy [M, N], their per-group 128x1 quantizations, the group columns a_g, the token-block offsets,
    DeepGEMM's per-group token counts (host list and int32 tensor) and operand pairs."""
    sizes = make_group_sizes(M, G, dist, seed=1).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, generator=gen, device="cuda").bfloat16()
    dy = torch.randn(M, N, generator=gen, device="cuda").bfloat16()
    xt, xs = quant.quantize_grouped_128x1(x, sizes)
    dyt, dys = quant.quantize_grouped_128x1(dy, sizes)
    a = aligned_token_offsets(sizes).tolist()
    blocks = token_block_offsets(sizes).tolist()
    ks = [a[g + 1] - a[g] for g in range(G)]
    return types.SimpleNamespace(
        sizes=sizes, x=x, dy=dy, xt=xt, xs=xs, dyt=dyt, dys=dys, a=a, blocks=blocks, ks=ks,
        ks_t=torch.tensor(ks, dtype=torch.int32, device="cuda"),
        dg_a=deepgemm_operands(dyt, dys, a, blocks[-1]), dg_b=deepgemm_operands(xt, xs, a, blocks[-1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=ISSUE_SHAPES)
    ap.add_argument("--dist", default="paper")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--block-m", type=int, default=0,
                    help="our output tile's rows (128 or 192; 0: the default, and no block_m argument passed)")
    args = ap.parse_args()
    tile = {"block_m": args.block_m} if args.block_m else {}  # builds before the block_m argument take none
    import deep_gemm

    rows = []
    for spec in args.shapes.split(","):
        G, M, N, K = map(int, spec.split(":"))
        w = wgrad_operands(G, M, N, K, args.dist)
        sizes, x, dy, xt, xs, dyt, dys = w.sizes, w.x, w.dy, w.xt, w.xs, w.dyt, w.dys
        ks, ks_t, dg_a, dg_b = w.ks, w.ks_t, w.dg_a, w.dg_b
        c0 = torch.randn(G, N, K, device="cuda")
        ours_d, dg_d = c0.clone(), c0.clone()
        k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=ours_d, accumulate=True, **tile)
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous(dg_a, dg_b, dg_d, ks, ks_t, dg_d)
        torch.cuda.synchronize()
        bitexact = torch.equal(ours_d, dg_d)
        # BF16 baseline: torch._grouped_mm 2d-2d over 16-aligned groups (what a BF16 user runs), built untimed.
        offs16 = torch.cumsum(((sizes + 15) // 16 * 16).clamp(min=16), 0).int()  # it needs non-empty groups
        p16 = int(offs16[-1])
        idx = torch.cat([torch.arange(int(o), int(o) + int(m), device="cuda") for o, m in
                         zip(torch.cat([offs16.new_zeros(1), offs16[:-1]]).tolist(), sizes.tolist())])
        dy16 = torch.zeros(p16, N, dtype=torch.bfloat16, device="cuda")
        x16 = torch.zeros(p16, K, dtype=torch.bfloat16, device="cuda")
        dy16[idx], x16[idx] = dy, x
        main_grad = c0.clone()
        fns = {
            "ours_fp32acc": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=main_grad, accumulate=True, **tile),
            "deepgemm_fp32acc": lambda: deep_gemm.k_grouped_fp8_gemm_nt_contiguous(dg_a, dg_b, dg_d, ks, ks_t, dg_d),
            "ours_bf16": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out_dtype=torch.bfloat16, **tile),
            "bf16_grouped_mm": lambda: torch._grouped_mm(dy16.t(), x16, offs=offs16),
        }
        times = common.bench_interleaved(fns, iters=args.iters)
        flops = 2.0 * M * N * K
        row = {"G": G, "M": M, "N": N, "K": K, "dist": args.dist, "bitexact_vs_deepgemm": bitexact,
               **{f"{k}_ms": v for k, v in times.items()},
               **{f"{k}_tflops": flops / v / 1e9 for k, v in times.items()},
               "ours_vs_deepgemm": times["deepgemm_fp32acc"] / times["ours_fp32acc"],
               "ours_bf16_vs_bf16": times["bf16_grouped_mm"] / times["ours_bf16"]}
        rows.append(row)
        print(f"G={G:3d} M={M:6d} N={N:5d} K={K:5d}  ours {row['ours_fp32acc_tflops']:6.0f}  "
              f"deepgemm {row['deepgemm_fp32acc_tflops']:6.0f}  x{row['ours_vs_deepgemm']:.3f}  bits {bitexact}  |  "
              f"bf16-out ours {row['ours_bf16_tflops']:6.0f} torch-bf16 {row['bf16_grouped_mm_tflops']:6.0f} "
              f"x{row['ours_bf16_vs_bf16']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
