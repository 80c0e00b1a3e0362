"""Smallest end-to-end check of every CUDA op (first thing a device session runs, under `timeout`, so a hang
or a crash shows up in seconds instead of stalling the test suite)."""
import os
import sys

import torch

import megatron_tma
from megatron_tma import quant
from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma.activation import ACTIVATIONS, activation_times_probs
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
d = T.diff(y.double(), T.m_grouped_ref64(aq, a_s, wq, ws, sizes))
print(f"m_grouped diff vs float64: {d:.3e}", flush=True)
dy = torch.randn(M, N, device=dev).bfloat16()
xt, xs = R.quantize_grouped_128x1(x, sizes)
dyt, dys = R.quantize_grouped_128x1(dy, sizes)
dw = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes)
torch.cuda.synchronize()
ref = T.k_grouped_ref64(dyt, dys, xt, xs, sizes)
dk = max(T.diff(dw[g].double(), ref[g]) for g in (0, 2, 3))
dwb = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out_dtype=torch.bfloat16)  # BF16: the TMA-store epilogue
kb16 = torch.equal(dwb, dw.bfloat16())
c0 = torch.randn(G, N, K, device=dev)
dacc = c0.clone()
k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=dacc, accumulate=True)  # FP32: a TMA reduce-add into C
kb16 = kb16 and torch.equal(dacc, c0 + dw)
# The wgrad layout (docs/design.md §4): contiguous [K, P], P = round_up(M, 128) + 128 G, group g at column a_g (a
# multiple of 128), every other column zero; and the bits of the padded path (each group padded with zero tokens to a
# multiple of 128, quantized and multiplied by the same kernel).
P = -(-M // 128) * 128 + 128 * G
tok = torch.zeros(P, dtype=torch.bool, device=dev)
a = 0
for s in sizes.tolist():
    tok[a:a + s] = True
    a += -(-s // 128) * 128
klay = all(t.shape == (r, P) and t.is_contiguous() and not bool(t.view(torch.uint8)[:, ~tok].any())
           for t, r in ((xt, K), (dyt, N)))
x_pad, _, psizes = T.pad_groups_rows(x, None, sizes, 128)
dy_pad, _, _ = T.pad_groups_rows(dy, None, sizes, 128)
(xpt, xps), (dypt, dyps) = R.quantize_grouped_128x1(x_pad, psizes), R.quantize_grouped_128x1(dy_pad, psizes)
kpad = torch.equal(k_grouped_fp8_gemm(dypt, dyps, xpt, xps, psizes), dw)
kpad = kpad and torch.equal(k_grouped_fp8_gemm(dypt, dyps, xpt, xps, psizes, out_dtype=torch.bfloat16), dwb)
dpad = c0.clone()
k_grouped_fp8_gemm(dypt, dyps, xpt, xps, psizes, out=dpad, accumulate=True)
kpad = kpad and torch.equal(dpad, dacc)
print(f"k_grouped diff vs float64: {dk:.3e}, empty group zero: {bool((dw[1] == 0).all())}, "
      f"bf16 out = rounded fp32 and accumulate = C + result: {kb16}, [K, P] layout: {klay}, "
      f"padded path's bits: {kpad}", flush=True)
# The CUDA quantizers against the reference, bit for bit; runs of 3 and of 1 token-block slots so that the grouped
# kernels' parked-line path and its plain path both run on this small input (memcheck covers them).
os.environ["MEGATRON_TMA_QUANT_RUN"] = "3"
pairs = [(quant.quantize_1x128(x, backend="cuda"), R.quantize_1x128(x)),
         (quant.quantize_128x128(w, backend="cuda"), R.quantize_128x128(w)),
         (quant.quantize_grouped_128x1(x, sizes, backend="cuda"), R.quantize_grouped_128x1(x, sizes)),
         (quant.quantize_1x128_and_grouped_128x1(dy, sizes, backend="cuda"),
          R.quantize_1x128(dy) + R.quantize_grouped_128x1(dy, sizes))]
os.environ["MEGATRON_TMA_QUANT_RUN"] = "1"
pairs.append((quant.quantize_grouped_128x1(x, sizes, backend="cuda"), R.quantize_grouped_128x1(x, sizes)))
del os.environ["MEGATRON_TMA_QUANT_RUN"]
torch.cuda.synchronize()
as_bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
qok = all(torch.equal(as_bits(o), as_bits(r)) for out, ref in pairs for o, r in zip(out, ref))
print(f"quantizers bit-exact vs reference: {qok}", flush=True)
# The fused activation kernels, every activation, forward + backward, against the torch path (one bf16 rounding).
aok = True
for act in ACTIVATIONS:
    hh = torch.randn(M, 2 * N if act == "swiglu" else N, device=dev).bfloat16()
    pp = torch.rand(M, device=dev)
    outs = []
    for backend in ("cuda", "reference"):
        hl, pl = hh.clone().requires_grad_(), pp.clone().requires_grad_()
        z = activation_times_probs(hl, pl, act, backend=backend)
        z.backward(torch.ones_like(z))
        outs.append((z.detach(), hl.grad, pl.grad))
    torch.cuda.synchronize()
    aok &= all(torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6) for a, b in zip(*outs))
print(f"activation kernels close to the torch path: {aok}", flush=True)
ok = d < 1e-3 and dk < 1e-3 and kb16 and klay and kpad and qok and aok
print("SMOKE", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
