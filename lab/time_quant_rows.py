"""The grouped quantizers on the shapes that decide the layer and the model step, for A/B of builds
(lab/ab_quant.sh): one JSON line of TB/s per shape (bytes read + written, scales not counted; CUDA events, L2
flushed, median), and with --save / --compare every output byte of each call, so that two builds can be held
equal bit for bit.

    python lab/time_quant_rows.py [--iters 30] [--save F | --compare F]

Shapes: the DeepSeek-V3-like recipe preset's four fused calls per MoE layer (16384 tokens x top-8 = 131072 rows
over 64 experts: x at hidden 2048, the activation output at FFN 640, dY at 2048, dZ at 2 x 640), the layer
benchmark's DeepSeek-V3 G=32 fc1 input and Qwen3 G=128 rows, and the quantizer benchmark's headline columns-only
shape. Inputs: Gaussian rows scaled per row by 2^-8..2^8 (bench_quant.py's spread), paper group sizes, seed 0.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_quant import _rows_with_spread, _same  # noqa: E402

from megatron_tma.groups import make_group_sizes, wgrad_pitch  # noqa: E402
from megatron_tma.quant import quantize_1x128_and_grouped_128x1, quantize_grouped_128x1  # noqa: E402

# (name, M, K, G, fused rows + columns)
SHAPES = [("model x", 131072, 2048, 64, True), ("model h", 131072, 640, 64, True),
          ("model dz", 131072, 1280, 64, True), ("dsv3 G32 x", 32768, 7168, 32, True),
          ("qwen3 G128 x", 32768, 2048, 128, True), ("cols 65536x7168 G32", 65536, 7168, 32, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--save", help="write every output of every shape to this file (torch.save)")
    group.add_argument("--compare", help="compare every output with a --save file; exit 1 on any difference")
    args = ap.parse_args()
    common.require_kernels()
    fns, nbytes, outputs = {}, {}, {}
    for name, m, k, g, fused in SHAPES:
        x = _rows_with_spread(m, k, torch.Generator(device="cuda").manual_seed(0))
        sizes = make_group_sizes(m, g, "paper", 0).to("cuda", torch.int32)
        if fused:
            fns[name] = (lambda x=x, s=sizes, g=g: quantize_1x128_and_grouped_128x1(x, s, num_groups=g))
            nbytes[name] = 3 * x.numel() + k * wgrad_pitch(m, g)  # x read, q [M, K] and qt [K, P] written
        else:
            fns[name] = (lambda x=x, s=sizes, g=g: quantize_grouped_128x1(x, s, num_groups=g))
            nbytes[name] = 2 * x.numel() + k * wgrad_pitch(m, g)
        if args.save or args.compare:
            outputs[name] = [t.cpu() for t in fns[name]()]
    if args.save:
        torch.save(outputs, args.save)
    if args.compare:
        ref = torch.load(args.compare)
        bad = [name for name in outputs  # bench_quant's bit equality: FP8 compared as bytes, shapes included
               if len(ref[name]) != len(outputs[name]) or not _same(outputs[name], ref[name])]
        print(json.dumps({"bits_equal": not bad, "different": bad, "shapes": len(outputs)}))
        sys.exit(1 if bad else 0)
    if args.save:
        print(json.dumps({"saved": args.save, "shapes": len(outputs)}))
        return
    times = common.bench_interleaved(fns, iters=args.iters)
    print(json.dumps({name: round(nbytes[name] / times[name] / 1e9, 4) for name in fns}))


if __name__ == "__main__":
    main()
