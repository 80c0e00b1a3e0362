"""The two references for m_tile_ceiling.cu, on the same shape and protocol: dense cuBLAS FP8 (torch._scaled_mm,
tensorwise scales) and the package's M-grouped kernel with one group (the production kernel on a dense problem).
    python3 lab/ceiling/reference_rates.py [M N K]      (GPU machine, extension built in place)"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import common  # noqa: E402
from megatron_tma import gemm, quant  # noqa: E402

m, n, k = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (16384, 4096, 4096)
flops = 2 * m * n * k
a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
one = torch.ones((), device="cuda")
aq, a_s = quant.quantize_1x128(torch.randn(m, k, device="cuda").bfloat16())
wq, ws, _, _ = quant.quantize_128x128(torch.randn(1, n, k, device="cuda").bfloat16())
groups = torch.tensor([m], device="cuda", dtype=torch.int32)
out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
res = common.bench_interleaved({
    "dense_cublas": lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16),
    "m_grouped_G1": lambda: gemm.m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out),
})
for name, ms in res.items():
    print(f"{name:12s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOPS")
