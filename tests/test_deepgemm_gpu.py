"""Bits against DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM) on the same FP8 bytes and scales, padded as its SM90 grouped
kernels require (benchmarks/deepgemm_baseline.py): the M-grouped GEMM (forward and dgrad, BF16 out) against
m_grouped_fp8_gemm_nt_contiguous on pad_rows_fp8's operands, valid rows only; the K-grouped wgrad (FP32 accumulate
into a non-zero C) against k_grouped_fp8_gemm_nt_contiguous. Groups of 0, 1, 127, 128 and 129 tokens included.
Skipped without a Hopper GPU + extension, or without an importable deep_gemm."""
import os
import sys

import pytest
import torch

from megatron_tma import _ext, quant
from megatron_tma.gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes
from megatron_tma.padding import pad_rows_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import deepgemm_baseline as dgb  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
DEV = "cuda"
EDGE = [0, 1, 127, 128, 129]


@pytest.fixture(scope="module")
def dg():
    module, why = dgb.load()
    if module is None:
        pytest.skip(f"deep_gemm is not importable: {why}")
    dgb.check_alignment(module)
    return module


def _sizes(spec, m, g, seed):
    return torch.tensor(spec, dtype=torch.int64) if spec is not None else make_group_sizes(m, g, "with_empty", seed)


@pytest.mark.parametrize("spec,m,g,n,k,dgrad", [
    (EDGE, None, None, 256, 384, False),
    ([129, 0, 128, 1, 0, 127, 0], None, None, 512, 256, False),
    (None, 3000, 6, 1536, 1024, False),
    (None, 8192, 8, 4096, 2048, False),
    (EDGE, None, None, 384, 768, True),       # dgrad: dX = dY . W, contraction over N
    (None, 2000, 4, 1024, 2048, True),
])
def test_m_grouped_equals_deepgemm(dg, spec, m, g, n, k, dgrad):
    sizes = _sizes(spec, m, g, seed=n + k)
    m, g = int(sizes.sum()), len(sizes)
    gen = torch.Generator(device=DEV).manual_seed(m + n + k)
    w = (torch.randn(g, n, k, generator=gen, device=DEV) * 0.05).bfloat16()
    wq, ws, wtq, wts = quant.quantize_128x128(w)
    b, bs, kk, nn = (wtq, wts, n, k) if dgrad else (wq, ws, k, n)
    x = (torch.randn(m, kk, generator=gen, device=DEV)
         * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen, device=DEV).float())).bfloat16()
    aq, a_s = quant.quantize_1x128(x)
    groups = sizes.to(DEV)
    ours = m_grouped_fp8_gemm(aq, a_s, b, bs, groups)
    a_pad, a_s_pad, _ = pad_rows_fp8(aq, a_s, groups, 128, num_groups=g)
    args = dgb.m_grouped_args(a_pad, a_s_pad, b, bs, sizes)
    d = torch.full((a_pad.shape[0], nn), float("nan"), dtype=torch.bfloat16, device=DEV)
    dgb.run_m_grouped(dg, args, d)
    got = d[dgb.valid_rows(sizes).to(DEV)]
    assert not got.isnan().any()
    assert torch.equal(got, ours), f"max |diff| {(got.float() - ours.float()).abs().max().item()}"


@pytest.mark.parametrize("spec,m,g,n,k", [
    (EDGE, None, None, 256, 512),
    ([129, 0, 128, 1, 0, 127, 0], None, None, 384, 256),
    ([0, 0, 0], None, None, 256, 256),          # nothing to add: C stays as it is
    ([1000], None, None, 768, 1408),
    (None, 4096, 8, 2048, 1024),
    (None, 16384, 8, 4096, 4096),
])
def test_k_grouped_accumulate_equals_deepgemm(dg, spec, m, g, n, k):
    sizes = _sizes(spec, m, g, seed=n + k)
    m, g = int(sizes.sum()), len(sizes)
    gen = torch.Generator(device=DEV).manual_seed(3 * m + n + k)
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    dy = (torch.randn(m, n, generator=gen, device=DEV)
          * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen, device=DEV).float())).bfloat16()
    groups = sizes.to(DEV)
    xt, xs = quant.quantize_grouped_128x1(x, groups)
    dyt, dys = quant.quantize_grouped_128x1(dy, groups)
    c = torch.randn(g, n, k, generator=gen, device=DEV) * 32  # a non-zero C: D = C + dY^T . X
    ours = c.clone()
    k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=ours, accumulate=True)
    theirs = c.clone()
    dgb.run_k_grouped(dg, dgb.k_grouped_args(dyt, dys, xt, xs, sizes), theirs)
    assert torch.equal(theirs, ours), f"max |diff| {(theirs - ours).abs().max().item()}"
    for gi, s in enumerate(sizes.tolist()):
        if s == 0:
            assert torch.equal(theirs[gi], c[gi])
