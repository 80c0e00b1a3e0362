"""The K-grouped GEMM's two tiles give the same bits: 128 x 128 (two math warpgroups, `block_m=128`) and 192 x 128
(three, `block_m=192`), and the default (`block_m=0`) is the tile `k_grouped_tile` reports. Cases where the 192-row tile differs in what it does: N below 192 and N % 192 != 0
(warpgroups whose rows are all past N), K off the 128-column grid, a D that is not 16-byte aligned (the register
epilogue), accumulation with empty groups, FP32 and BF16 outputs, and the group count where the 192-row tile's
shared memory runs out (975 fits, 976 runs 128 x 128). Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma.gemm import k_grouped_fp8_gemm, k_grouped_tile
from megatron_tma.groups import make_group_sizes

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
DEV = "cuda"
# (G, M, N, K, distribution)
CASES = [(8, 16384, 4096, 4096, "paper"), (4, 3000, 64, 256, "paper"), (3, 1000, 128, 400, "balanced"),
         (5, 2500, 272, 384, "paper"), (975, 975 * 130, 256, 128, "balanced"), (976, 976 * 130, 256, 128, "balanced")]


def _outputs(case, block_m):
    """One case's outputs with one tile: FP32, BF16, FP32 into a 4-byte-offset D, and (G <= 8) FP32 accumulated
    into C with two empty groups."""
    G, M, N, K, dist = case
    i = CASES.index(case)
    sizes = make_group_sizes(M, G, dist, seed=i).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(100 + i)
    x = torch.randn(M, K, generator=gen, device=DEV).bfloat16()
    dy = torch.randn(M, N, generator=gen, device=DEV).bfloat16()
    xt, xs = R.quantize_grouped_128x1(x, sizes)
    dyt, dys = R.quantize_grouped_128x1(dy, sizes)
    args = (dyt, dys, xt, xs, sizes)
    outs = [k_grouped_fp8_gemm(*args, block_m=block_m),
            k_grouped_fp8_gemm(*args, out_dtype=torch.bfloat16, block_m=block_m)]
    flat = torch.full((G * N * K + 1,), float("nan"), device=DEV)
    odd = flat[1:].view(G, N, K)  # 4 bytes past a 16-byte boundary: the register epilogue
    outs.append(k_grouped_fp8_gemm(*args, out=odd, block_m=block_m))
    if G <= 8:
        empty = sizes.clone()
        empty[-1] += empty[0] + empty[1]
        empty[:2] = 0
        xt, xs = R.quantize_grouped_128x1(x, empty)
        dyt, dys = R.quantize_grouped_128x1(dy, empty)
        c = torch.randn(G, N, K, generator=gen, device=DEV)
        outs.append(k_grouped_fp8_gemm(dyt, dys, xt, xs, empty, out=c, accumulate=True, block_m=block_m))
    return outs


@pytest.mark.parametrize("case", CASES, ids=[f"G{c[0]}-N{c[2]}-K{c[3]}" for c in CASES])
def test_192_row_tile_gives_the_128_row_tiles_bits(case):
    ref = _outputs(case, 128)
    for block_m in (192, 0):
        for i, (a, b) in enumerate(zip(ref, _outputs(case, block_m), strict=True)):
            assert a.dtype == b.dtype and not a.float().isnan().any() and torch.equal(a, b), (block_m, f"output {i}")


def test_default_tile_reported_by_k_grouped_tile():
    """The rows the launcher picks (scheduler/k_grouped_tile_choice.h, tested in full on the CPU) are what
    k_grouped_tile reports, including the fallback where the 192-row tile's shared memory does not fit G's offsets."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert k_grouped_tile(4096, 4096, 8) == (192, 128)                     # many rounds of tiles
    assert k_grouped_tile(4096, 4096, 8, torch.bfloat16) == (192, 128)
    assert k_grouped_tile(256, 128, 1) == (128, 128)                       # less than one round
    assert k_grouped_tile(4096, 4096, 8, block_m=128) == (128, 128)
    assert k_grouped_tile(128, 128, 1, block_m=192) == (192, 128)
    assert k_grouped_tile(384, 128, 975) == ((192, 128) if 975 * 3 > sms else (128, 128))
    assert k_grouped_tile(384, 128, 976, block_m=192) == (128, 128)        # 976 offsets: no room
    with pytest.raises(ValueError, match="block_m must be"):
        k_grouped_tile(256, 256, 8, block_m=64)
    with pytest.raises(TypeError, match="out_dtype must be"):
        k_grouped_tile(256, 256, 8, torch.float16)
