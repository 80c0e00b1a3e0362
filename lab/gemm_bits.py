"""Outputs of the M-grouped GEMM (every tile shape) on fixed inputs, saved by one build and compared bit for bit
by another: the check that a post-build change to the extension (a SASS hint patch, another ptxas flag) left the
numerics alone. The GPU tests cannot tell: their oracle, the padded path, runs the same patched kernel.

    python lab/gemm_bits.py save /tmp/bits.pt        # with the reference build
    python lab/gemm_bits.py compare /tmp/bits.pt     # with the changed build: exit 1 on any differing bit
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's package

from megatron_tma import reference as R
from megatron_tma.gemm import m_grouped_fp8_gemm

# (group sizes, N, K): unaligned groups, an empty one, a partial last tile, N that 256- and 192-wide tiles leave partial
CASES = [([1000, 0, 129, 3000, 77], 4096, 2048), ([4096, 4096], 2048, 7168), ([513] * 8, 768, 1024)]
TILES = [(128, 128), (128, 192), (128, 256), (192, 128)]  # every kernel the extension builds (block_m, block_n)


def outputs():
    outs = {}
    for i, (sizes, n, k) in enumerate(CASES):
        gen = torch.Generator(device="cuda").manual_seed(1234 + i)
        groups = torch.tensor(sizes, device="cuda")
        m, g = sum(sizes), len(sizes)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(g, n, k, device="cuda", generator=gen) * 0.05).bfloat16()
        aq, a_s = R.quantize_1x128(x)
        wq, ws, _, _ = R.quantize_128x128(w)
        for bm, bn in TILES:
            # backend="cuda": an unbuilt extension must fail here, not compare the torch reference with itself
            outs[f"case{i}_bm{bm}_bn{bn}"] = m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, backend="cuda", block_m=bm,
                                                                block_n=bn).cpu()
    return outs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("path")
    args = ap.parse_args()
    outs = outputs()
    if args.action == "save":
        torch.save(outs, args.path)
        print(f"saved {len(outs)} outputs to {args.path}")
        return 0
    ref = torch.load(args.path, weights_only=True)  # a file this run did not write: tensors only
    if ref.keys() != outs.keys():
        print(f"different cases: {sorted(ref)} vs {sorted(outs)}")
        return 1
    bad = [name for name in ref if not torch.equal(ref[name], outs[name])]
    print(f"{len(ref) - len(bad)} of {len(ref)} outputs bit-identical" + (f"; differ: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
