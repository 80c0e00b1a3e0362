"""Our M-grouped kernel against DeepGEMM 2.6.1's on one shape, the same FP8 data, in one process: bits compared,
each method timed (CUDA events, L2 flushed, carry-over-balanced rounds as the benchmarks), DeepGEMM's chosen layout
printed (DG_PRINT_CONFIGS=1, set before it is imported). Made to sit under ncu: every method runs `--calls` times
after its warm-up, in a fixed order, so `--launch-skip` / `--launch-count` select whole methods.

    python lab/mgrouped_vs_deepgemm.py --shape 8:65536:6144:5120 [--dist paper] [--tiles 192x128,128x192]
    ncu --kernel-name regex:"m_grouped_fp8_gemm_kernel|sm90_fp8_gemm_1d2d" --launch-count 4 \\
        python lab/mgrouped_vs_deepgemm.py --shape 8:65536:6144:5120 --iters 0 --calls 2

Why: on an H100 DeepGEMM beat our kernel by up to 14% on the big rows of the grid even on the same padded data
(benchmarks/NOTES.md, "Ratios move with the GPU"); its heuristics (heuristics/sm90.hpp) pick 128 x 192 tiles with a
2-CTA cluster that multicasts the weight tile to two M tiles there. This tool is the measurement that says whether
that, or something else, is the difference.
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DG_PRINT_CONFIGS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import bench_m_grouped  # noqa: E402
import common  # noqa: E402
import deepgemm_baseline  # noqa: E402
from megatron_tma.gemm import m_grouped_fp8_gemm, m_grouped_tile  # noqa: E402
from megatron_tma.padding import pad_rows_fp8  # noqa: E402


def parse_shape(text):
    try:
        g, m, n, k = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape is G:M:N:K, got {text!r}") from None
    return g, m, n, k


def parse_tiles(text):
    tiles = []
    for t in filter(None, text.split(",")):
        try:
            bm, bn = (int(v) for v in t.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tiles is BMxBN[,BMxBN...], got {t!r}") from None
        tiles.append((bm, bn))
    return tiles


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=parse_shape, default=(8, 65536, 6144, 5120), help="G:M:N:K")
    ap.add_argument("--dist", choices=bench_m_grouped.DISTS, default="paper")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--tiles", type=parse_tiles, default=[(192, 128), (128, 192)],
                    help="our forced tiles timed beside the default (BMxBN, comma-separated)")
    ap.add_argument("--iters", type=int, default=20, help="timed rounds (0: none, for ncu)")
    ap.add_argument("--calls", type=int, default=1, help="untimed calls per method after the warm-up (for ncu)")
    ap.add_argument("--sustained", type=int, default=0,
                    help="then each method N calls back to back (no flush; forward order, then reverse), with the SM "
                         "clock and board power sampled by nvidia-smi: time per call at the clocks a long run holds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dg, why = deepgemm_baseline.load()
    if dg is None:
        sys.exit(f"DeepGEMM is not importable: {why}")

    G, M, N, K = args.shape
    sizes, groups, _, _, aq, a_s, wq, ws = bench_m_grouped.make_inputs(G, M, N, K, args.dist, args.seed)
    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    a_pad, a_s_pad, pad_off = pad_rows_fp8(aq, a_s, groups, 128, num_groups=G)
    deepgemm_baseline.check_alignment(dg)
    dg_args = deepgemm_baseline.m_grouped_args(a_pad, a_s_pad, wq, ws, sizes)
    d_dg = torch.empty(a_pad.shape[0], N, dtype=torch.bfloat16, device="cuda")

    fns = {"ours": lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out)}
    for bm, bn in args.tiles:
        fns[f"ours_{bm}x{bn}"] = (lambda bm=bm, bn=bn:
                                  m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=bm, block_n=bn))
    fns["ours_padded"] = lambda: m_grouped_fp8_gemm(a_pad, a_s_pad, wq, ws, pad_off)
    fns["deepgemm"] = lambda: deepgemm_baseline.run_m_grouped(dg, dg_args, d_dg)

    ref = m_grouped_fp8_gemm(aq, a_s, wq, ws, groups).clone()
    deepgemm_baseline.run_m_grouped(dg, dg_args, d_dg)  # also its JIT compile and the config print
    valid = deepgemm_baseline.valid_rows(sizes).cuda()
    print(f"G={G} M={M} N={N} K={K} {args.dist}: our default tile {'%dx%d' % m_grouped_tile(M, N, G)}, "
          f"padding {a_pad.shape[0] - M} rows; DeepGEMM bits equal ours: {torch.equal(d_dg[valid], ref)}", flush=True)
    for name, fn in fns.items():  # a fixed order, so that ncu's launch ranges pick whole methods
        fn()
        torch.cuda.synchronize()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
    if args.iters:
        ms = common.bench_interleaved(fns, iters=args.iters)
        flops = 2.0 * M * N * K
        for name, t in ms.items():
            line = f"  {name:>14}: {t:.4f} ms" if isinstance(t, float) else f"  {name:>14}: {t}"
            if isinstance(t, float):
                line += f", {flops / (t * 1e-3) / 1e12:.0f} TFLOPS"
                if isinstance(ms.get("deepgemm"), float):
                    line += f", DeepGEMM / this {ms['deepgemm'] / t:.3f}"
            print(line, flush=True)
    if args.sustained:
        sustained(fns, args.sustained, 2.0 * M * N * K)


def sustained(fns, calls, flops):
    """Each method `calls` times back to back, twice (forward order, then reverse) after an unrecorded warm-up pass;
    per method the time per call and the mean SM clock and power over its windows. Says whether a timed gap is the kernel (same clock, more time) or
    the power limit (the clock drops under one method's load more than under another's)."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=log, stderr=subprocess.DEVNULL)
    windows, per_call = {n: [] for n in fns}, {n: [] for n in fns}
    try:
        time.sleep(0.5)
        # a first pass, not recorded, brings the board to the power limit the recorded ones run at: measured without
        # it, the first method's window read ~120 W and ~5% lower time per call than its own reverse-order window
        for pass_index, order in enumerate((list(fns)[::-1], list(fns), list(fns)[::-1])):
            for name in order:
                fn = fns[name]
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.time()
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                if pass_index:
                    windows[name].append((t0, time.time()))
                    per_call[name].append(start.elapsed_time(end) / calls)
        time.sleep(0.1)
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(log.name):
        parts = [v.strip() for v in line.split(",")]
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((ts, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    os.unlink(log.name)
    print(f"sustained: {calls} calls back to back per method and pass, {len(samples)} nvidia-smi samples", flush=True)
    for name in fns:
        # skip the first 30% of each window: the clock settles after the previous method's load
        inside = [(c, w) for a, b in windows[name] for ts, c, w in samples if a + 0.3 * (b - a) <= ts <= b]
        clock = sum(c for c, _ in inside) / len(inside) if inside else float("nan")
        power = sum(w for _, w in inside) / len(inside) if inside else float("nan")
        ms = sum(per_call[name]) / len(per_call[name])
        print(f"  {name:>14}: {ms:.4f} ms/call ({' / '.join('%.4f' % v for v in per_call[name])}), "
              f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOPS, SM {clock:.0f} MHz, {power:.0f} W, {len(inside)} samples, "
              f"{ms * power:.1f} mJ/call", flush=True)


if __name__ == "__main__":
    main()
