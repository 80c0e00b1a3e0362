"""The K-grouped kernel on the shapes that decide the layer benchmark (benchmarks/NOTES.md, K-grouped section):
the issue's two reference shapes and the wgrads of the Mixtral / DeepSeek-V3 / Qwen3 layers, large and small
groups, FP32 accumulate and BF16 out. `fp32+=` accumulates into a 16-byte aligned C (shared-memory + TMA
epilogue), `fp32+=r` into one 8 bytes off (register epilogue): the A/B of the two FP32 epilogues. Prints ms, TFLOPS
and the roofline ratio of issue 4 (bench_k_grouped.roofline_ms: BF16 written, or FP32 read + written; ceilings
measured in the same process); `same` says that repeated calls give the same bits (and, for fp32+=r, the TMA
epilogue's bits). The operands are the quantizer's [K, P] / [N, P] columns, every group starting at a multiple
of 128 tokens (docs/design.md §4; P = round_up(M, 128) + 128 G, checked here). A quick look between full benchmark runs;
writes nothing.

    python lab/tune_k_grouped.py [--iters 15] [--quick]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_k_grouped import roofline_ms, wgrad_pitch  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm  # noqa: E402
from megatron_tma.groups import make_group_sizes  # noqa: E402

# (G, M, N, K): the issue's two reference shapes, the Mixtral / DeepSeek-V3 / Qwen3 layers' wgrads, small groups
SHAPES = [(8, 16384, 4096, 4096), (32, 8192, 4096, 7168), (8, 32768, 28672, 4096), (128, 32768, 1536, 2048),
          (8, 32768, 4096, 14336), (8, 32768, 4096, 7168), (128, 8192, 2048, 768)]  # --quick: the first four


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="the first four shapes only")
    args = ap.parse_args()
    ceil = common.measure_ceilings()
    print(f"ceilings: {ceil}")
    print(f"{'G':>4} {'M':>6} {'N':>6} {'K':>6} {'out':7} {'same':6} {'ms':>9} {'TFLOPS':>7} {'x roof':>6}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for G, M, N, K in SHAPES[:4] if args.quick else SHAPES:
        groups = make_group_sizes(M, G, "paper", seed=G + M).cuda()
        x = torch.randn(M, K, generator=gen, device="cuda").bfloat16()
        dy = torch.randn(M, N, generator=gen, device="cuda").bfloat16()
        xt, xs = quant.quantize_grouped_128x1(x, groups)
        dyt, dys = quant.quantize_grouped_128x1(dy, groups)
        assert xt.shape == (K, wgrad_pitch(M, G)) and dyt.shape == (N, wgrad_pitch(M, G)), (xt.shape, dyt.shape)
        del x, dy
        flops = 2.0 * M * N * K
        c_shared = torch.randn(G, N, K, generator=gen, device="cuda")  # one C for both FP32 rows: same bits expected
        for out in ("fp32+=", "fp32+=r", "bf16"):
            # fp32+=r: the same accumulate into an `out` 8 bytes off 16-byte alignment, which takes the
            # register epilogue instead of shared memory + TMA (same bits; the A/B of the two epilogues)
            c = c_shared if out.startswith("fp32") else None
            roof = roofline_ms(G, M, N, K, "fp32_acc" if c is not None else "bf16", ceil)
            if c is not None:
                def fresh_c(c=c):  # a copy of C, 16-byte aligned (fp32+=) or 8 bytes past it (fp32+=r)
                    shift = 2 if out == "fp32+=r" else 0
                    buf = torch.empty(c.numel() + 4, device="cuda")
                    view = buf[shift:shift + c.numel()].view_as(c)
                    view.copy_(c)
                    return view
                first, again = fresh_c(), fresh_c()
                k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=first, accumulate=True)
                k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=again, accumulate=True)
                work = fresh_c()
                ms = common.bench(lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=work, accumulate=True),
                                  iters=args.iters)
                del work
            else:
                first = k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=torch.bfloat16)
                again = k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=torch.bfloat16)
                ms = common.bench(lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out_dtype=torch.bfloat16),
                                  iters=args.iters)
            same = torch.equal(first, again)
            if out == "fp32+=":
                tma_result = first.clone()
            elif out == "fp32+=r":  # the register epilogue must give the TMA epilogue's bits
                same = same and torch.equal(first, tma_result)
                del tma_result
            print(f"{G:>4} {M:>6} {N:>6} {K:>6} {out:7} {str(same):6} {ms:9.3f} {flops / ms / 1e9:7.0f} {ms / roof:6.2f}",
                  flush=True)
            del first, again, c
            torch.cuda.empty_cache()
        del c_shared


if __name__ == "__main__":
    main()
