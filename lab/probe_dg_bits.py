"""Lab probe (not part of the product): where DeepGEMM 2.6.1's K-grouped kernel and ours disagree, and which one is
right. For each shape: both kernels on the same FP8 operands and scales (`kgrouped_vs_deepgemm.wgrad_operands`; FP32
out from zero), the groups whose outputs differ, their sizes, and for the first such group the float64 result of its
token blocks from the same bytes and scales against both. Needs `deep_gemm` importable.

    python lab/probe_dg_bits.py [--shapes G:M:N:K,...] [--dist paper]
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from kgrouped_vs_deepgemm import wgrad_operands  # noqa: E402

from megatron_tma.gemm import k_grouped_fp8_gemm  # noqa: E402


def float64_group(dyt, dys, xt, xs, a, blocks, g, N, K):
    """Group g's weight gradient in float64: each 128-token block's exact product times its row x column scales."""
    ref = torch.zeros(N, K, dtype=torch.float64, device=dyt.device)
    for j in range(blocks[g], blocks[g + 1]):
        t0 = a[g] + 128 * (j - blocks[g])
        p = dyt[:, t0:t0 + 128].double() @ xt[:, t0:t0 + 128].double().t()
        ref += p * dys[j, :N].double()[:, None] * xs[j, :K].double()[None, :]
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:32768:1536:2048,64:32768:1536:2048,128:65536:1536:2048,32:8192:4096:7168")
    ap.add_argument("--dist", default="paper")
    args = ap.parse_args()
    import deep_gemm

    for spec in args.shapes.split(","):
        G, M, N, K = map(int, spec.split(":"))
        w = wgrad_operands(G, M, N, K, args.dist)
        sizes, xt, xs, dyt, dys, a, blocks = w.sizes, w.xt, w.xs, w.dyt, w.dys, w.a, w.blocks
        ours = torch.zeros(G, N, K, device="cuda")
        dg = torch.zeros(G, N, K, device="cuda")
        k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=ours, accumulate=True, backend="cuda")
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous(w.dg_a, w.dg_b, dg, w.ks, w.ks_t, dg)
        torch.cuda.synchronize()
        bad = [g for g in range(G) if not torch.equal(ours[g], dg[g])]
        print(f"G={G} M={M} N={N} K={K}: equal {not bad}, {len(bad)} groups differ (sizes "
              f"{[int(sizes[g]) for g in bad[:12]]}), {int((ours != dg).sum())} elements, max diff "
              f"{float((ours - dg).abs().max()):.4g}; smallest group {int(sizes.min())}", flush=True)
        if bad:
            g = bad[0]
            ref = float64_group(dyt, dys, xt, xs, a, blocks, g, N, K)
            print(f"  group {g} ({int(sizes[g])} tokens) against float64: ours max |diff| "
                  f"{float((ours[g].double() - ref).abs().max()):.4g}, DeepGEMM "
                  f"{float((dg[g].double() - ref).abs().max()):.4g}", flush=True)


if __name__ == "__main__":
    main()
