"""Run each grouped GEMM a few times on one shape, for `ncu` to profile (see benchmarks/NOTES.md for the command
and what its sections showed). Default: G=8, M=16384, N=K=4096, paper sizes, wgrad accumulating into FP32. The
wgrad operands are the quantizer's [N, P] / [K, P] columns, groups starting at multiples of 16 tokens
(docs/design.md §4, P = round_up(M, 128) + 128 G); their shapes are printed at the end.

    python lab/profile_gemms.py [--G 32 --M 8192 --N 4096 --K 7168] [--wgrad-out bf16|none] [--block-m 192]
"""
import argparse

import torch

from megatron_tma import quant
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--G", type=int, default=8)
ap.add_argument("--M", type=int, default=16384)
ap.add_argument("--N", type=int, default=4096)
ap.add_argument("--K", type=int, default=4096)
ap.add_argument("--wgrad-out", choices=("fp32+=", "bf16", "none"), default="fp32+=",
                help="k-grouped output: accumulate into an FP32 main_grad, write BF16, or skip the k-grouped GEMM")
ap.add_argument("--block-m", type=int, default=0, help="m-grouped tile height (0: the default's choice, 128, 192)")
args = ap.parse_args()
G, M, N, K = args.G, args.M, args.N, args.K
dev = "cuda"
groups = make_group_sizes(M, G, "paper", 0).to(dev)
x = torch.randn(M, K, device=dev).bfloat16()
w = (torch.randn(G, N, K, device=dev) * 0.05).bfloat16()
dy = torch.randn(M, N, device=dev).bfloat16()
aq, a_s = quant.quantize_1x128(x)
wq, ws, _, _ = quant.quantize_128x128(w)
xt, xs = quant.quantize_grouped_128x1(x, groups)
dyt, dys = quant.quantize_grouped_128x1(dy, groups)
main_grad = torch.zeros(G, N, K, device=dev)
for _ in range(3):
    m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, block_m=args.block_m)
    if args.wgrad_out == "none":
        continue
    if args.wgrad_out == "bf16":
        k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=torch.bfloat16)
    else:
        k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=main_grad, accumulate=True)
torch.cuda.synchronize()
print(f"done (wgrad operands dy_t {tuple(dyt.shape)}, x_t {tuple(xt.shape)}, scales {tuple(xs.shape)})")
