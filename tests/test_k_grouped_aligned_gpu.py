"""EXPERIMENT (issue 4's layout question): the K-grouped kernel for groups that start on a 16-token boundary
(kernels/k_grouped_aligned_fp8_gemm.cuh, switched on by MEGATRON_TMA_KGROUPED_ALIGNED16=1 for BF16 outputs) gives
the realigning kernel's bits on such layouts: every group but the last holds a multiple of 16 tokens, so every
group starts aligned in the contiguous operands; last blocks are partial, groups empty, N and K off the tile grid.
Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma.gemm import k_grouped_fp8_gemm

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
DEV = "cuda"
ENV = "MEGATRON_TMA_KGROUPED_ALIGNED16"


def _operands(sizes, n, k, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    m = int(sizes.sum())
    x = torch.randn(m, k, generator=gen, device=DEV).bfloat16()
    dy = (torch.randn(m, n, generator=gen, device=DEV)
          * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen, device=DEV).float())).bfloat16()
    g = sizes.to(DEV)
    xt, xs = R.quantize_grouped_128x1(x, g)
    dyt, dys = R.quantize_grouped_128x1(dy, g)
    return dyt, dys, xt, xs, g


@pytest.mark.parametrize(
    "sizes,n,k",
    [
        (torch.tensor([512, 0, 144, 37]), 256, 384),            # partial last blocks (144 = 128 + 16), an empty group
        (torch.tensor([16, 48, 0, 272, 1000]), 272, 400),         # N and K not multiples of 128, a 16-token group
        (torch.tensor([1000]), 768, 1408),                      # one group, its last block partial
        (torch.tensor([256] * 32), 512, 512),                   # balanced, whole blocks only
        (torch.tensor([0, 0, 0, 5]), 128, 128),                 # only the last group holds tokens
    ],
)
def test_aligned_kernel_bits_equal_the_realigning_kernel(sizes, n, k, monkeypatch):
    assert all(int(s) % 16 == 0 for s in sizes[:-1]), "every group but the last must start 16-aligned"
    args = _operands(sizes, n, k, seed=int(sizes.sum()) + n)
    monkeypatch.delenv(ENV, raising=False)
    ref = k_grouped_fp8_gemm(*args, out_dtype=torch.bfloat16)
    monkeypatch.setenv(ENV, "1")
    out = torch.full((len(sizes), n, k), float("nan"), dtype=torch.bfloat16, device=DEV)
    k_grouped_fp8_gemm(*args, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert torch.equal(out, ref)
