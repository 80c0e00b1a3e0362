"""The K-grouped GEMM's two tiles give the same bits: 128 x 128 (two math warpgroups, the default) and 192 x 128
(three, `MEGATRON_TMA_KGROUPED_TILE=192`, read once per process, hence the second process). Cases where the 192-row
tile differs in what it does: N below 192 and N % 192 != 0 (warpgroups whose rows are all past N), K off the
128-column grid, a D that is not 16-byte aligned (the register epilogue), accumulation with empty groups, FP32 and
BF16 outputs, and the group count where the 192-row tile's shared memory runs out (975 fits, 976 falls back to
128 x 128). Skipped without a Hopper GPU + extension."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma.gemm import k_grouped_fp8_gemm
from megatron_tma.groups import make_group_sizes

DEV = "cuda"
# (G, M, N, K, distribution)
CASES = [(8, 16384, 4096, 4096, "paper"), (4, 3000, 64, 256, "paper"), (3, 1000, 128, 400, "balanced"),
         (5, 2500, 272, 384, "paper"), (975, 975 * 130, 256, 128, "balanced"), (976, 976 * 130, 256, 128, "balanced")]


def _outputs():
    """Every case's outputs in this process: FP32, BF16, FP32 into a 4-byte-offset D, and accumulated into C
    with two empty groups."""
    outs = []
    for i, (G, M, N, K, dist) in enumerate(CASES):
        sizes = make_group_sizes(M, G, dist, seed=i).to(DEV)
        gen = torch.Generator(device=DEV).manual_seed(100 + i)
        x = torch.randn(M, K, generator=gen, device=DEV).bfloat16()
        dy = torch.randn(M, N, generator=gen, device=DEV).bfloat16()
        xt, xs = R.quantize_grouped_128x1(x, sizes)
        dyt, dys = R.quantize_grouped_128x1(dy, sizes)
        args = (dyt, dys, xt, xs, sizes)
        outs.append(k_grouped_fp8_gemm(*args))
        outs.append(k_grouped_fp8_gemm(*args, out_dtype=torch.bfloat16))
        flat = torch.full((G * N * K + 1,), float("nan"), device=DEV)
        odd = flat[1:].view(G, N, K)  # 4 bytes past a 16-byte boundary: the register epilogue
        k_grouped_fp8_gemm(*args, out=odd)
        outs.append(odd.clone())
        if G <= 8:
            empty = sizes.clone()
            empty[0] = 0
            empty[-1] += sizes[0]
            empty[1] = 0
            empty[-1] += sizes[1]
            xt, xs = R.quantize_grouped_128x1(x, empty)
            dyt, dys = R.quantize_grouped_128x1(dy, empty)
            c = torch.randn(G, N, K, generator=gen, device=DEV)
            k_grouped_fp8_gemm(dyt, dys, xt, xs, empty, out=c, accumulate=True)
            outs.append(c)
    return [o.cpu() for o in outs]


@pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
def test_192_row_tile_gives_the_128_row_tiles_bits(tmp_path):
    assert os.environ.get("MEGATRON_TMA_KGROUPED_TILE") in (None, "", "128"), "this process must run the default tile"
    ours = _outputs()
    path = tmp_path / "tile192.pt"
    env = dict(os.environ, MEGATRON_TMA_KGROUPED_TILE="192")
    run = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    theirs = torch.load(path)
    assert len(theirs) == len(ours)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs between the 128- and 192-row tiles"


if __name__ == "__main__":  # the second process: the 192-row tile
    torch.save(_outputs(), sys.argv[1])
