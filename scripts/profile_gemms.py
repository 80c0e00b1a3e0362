"""Run each grouped GEMM a few times on one representative shape, for `ncu` to profile (see
benchmarks/NOTES.md for the command and what its sections showed)."""
import torch

from megatron_tma import quant
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes

G, M, N, K = 8, 16384, 4096, 4096
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
    m_grouped_fp8_gemm(aq, a_s, wq, ws, groups)
    k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=main_grad, accumulate=True)
torch.cuda.synchronize()
print("done")
