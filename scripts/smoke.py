"""Smallest end-to-end check of every CUDA op (first thing a device session runs, under `timeout`, so a hang
or a crash shows up in seconds instead of stalling the test suite)."""
import sys

import torch

import megatron_tma
from megatron_tma import reference as R
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm

print("extension:", megatron_tma.has_extension(), megatron_tma._ext.extension_error(), flush=True)
assert megatron_tma.cuda_kernels_available(), "no CUDA kernels"
dev = "cuda"
torch.manual_seed(0)
sizes = torch.tensor([100, 0, 129, 27], device=dev)
M, N, K, G = int(sizes.sum()), 256, 256, 4
x = torch.randn(M, K, device=dev).bfloat16()
w = (torch.randn(G, N, K, device=dev) * 0.05).bfloat16()
aq, a_s = R.quantize_1x128(x)
wq, ws, _, _ = R.quantize_128x128(w)
y = m_grouped_fp8_gemm(aq, a_s, wq, ws, sizes)
torch.cuda.synchronize()
d = R.diff(y.double(), R.m_grouped_ref64(aq, a_s, wq, ws, sizes))
print(f"m_grouped diff vs float64: {d:.3e}", flush=True)
dy = torch.randn(M, N, device=dev).bfloat16()
xt, xs = R.quantize_grouped_128x1(x, sizes)
dyt, dys = R.quantize_grouped_128x1(dy, sizes)
dw = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes)
torch.cuda.synchronize()
ref = R.k_grouped_ref64(dyt, dys, xt, xs, sizes)
dk = max(R.diff(dw[g].double(), ref[g]) for g in (0, 2, 3))
print(f"k_grouped diff vs float64: {dk:.3e}, empty group zero: {bool((dw[1] == 0).all())}", flush=True)
ok = d < 1e-3 and dk < 1e-3
print("SMOKE", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
