"""What the expert-MLP step would take if wgrad ran on 16-aligned group starts: a projection for the DESIGN.md §4
layout question (issue 4; `docs/proposal-wgrad-aligned-layout.md`), on the six layer rows with Transformer Engine
numbers (issue 5).

For each row (the layer benchmark's model, G, M and paper sizes with its seed) it times, in one process:
* the layer step of `ours` (fwd + bwd, weights re-quantized, `common.bench_blocks` as bench_mlp_layer.py);
* the step's four weight-gradient GEMMs (fc1 and fc2, BF16 `.grad` as in the layer), each twice, interleaved:
  `realigning` = our K-grouped kernel on the real group sizes (the §4 layout: groups start at any token), and
  `aligned` = the experimental kernel for 16-aligned starts (`MEGATRON_TMA_KGROUPED_ALIGNED16=1`) on the sizes
  rounded up to 16, i.e. on the token columns the proposed layout would hold (at most 15 zero columns per group,
  which that kernel would read as the zeros they are). Its bits are checked against the realigning kernel on the
  same rounded sizes.
and reports `projected_ms = step_ms - sum(realigning - aligned)`. That is a projection, not a measurement of a
layer: it assumes the column quantizers could write the aligned layout at the cost they have now (the same bytes
plus at most 15 zero columns per group) and that a GEMM's time in the step is its time alone.

    python benchmarks/project_layer_aligned_wgrad.py [--iters 25] [--out FILE.json]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_mlp_layer as bml  # noqa: E402
import common  # noqa: E402

from kgrouped_aligned_bound import aligned16  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm  # noqa: E402
from megatron_tma.mlp import GroupedFP8MLP  # noqa: E402


def wgrad_pair(sizes, n, k, gen, iters):
    """(realigning ms on `sizes`, aligned ms on `sizes` rounded up to 16, bits equal on the rounded sizes) for
    dW [G, n, k] = dY^T [n, tokens] . X [tokens, k]."""
    dev = sizes.device
    sizes16 = (sizes + 15) // 16 * 16
    ops = {}
    for name, s in (("real", sizes), ("rounded", sizes16)):
        m = int(s.sum())
        dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
        x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        ops[name] = (*quant.quantize_grouped_128x1(dy, s), *quant.quantize_grouped_128x1(x, s), s)
    g = sizes.numel()
    out_r = torch.empty(g, n, k, dtype=torch.bfloat16, device=dev)
    out_a = torch.empty_like(out_r)
    dyt, dys, xt, xs, s = ops["real"]
    dyt16, dys16, xt16, xs16, s16 = ops["rounded"]
    fns = {
        "realigning": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, s, out=out_r),
        "aligned": aligned16(lambda: k_grouped_fp8_gemm(dyt16, dys16, xt16, xs16, s16, out=out_a)),
    }
    times = common.bench_interleaved(fns, iters=iters)
    bits = torch.equal(fns["aligned"]().clone(), k_grouped_fp8_gemm(dyt16, dys16, xt16, xs16, s16,
                                                                   out_dtype=torch.bfloat16))
    return times["realigning"], times["aligned"], bits


def run_row(model, G, M, seed, iters):
    dev = "cuda"
    H, F, sizes, x, probs, dy = bml.layer_inputs(model, G, M, "paper", seed, dev)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)  # the wgrad operands below
    step = bml.Step(GroupedFP8MLP(G, H, F, "swiglu", device=dev), x, sizes.to(dev), probs, dy, requantize=True)
    step_ms = common.bench_blocks({"ours": step}, iters=iters)["ours"]
    del step
    row = {"model": model, "G": G, "M": M, "H": H, "F": F, "dist": "paper", "seed": seed,
           "extra_columns_pct": round(100.0 * float(((sizes + 15) // 16 * 16).sum() - M) / M, 2),
           "step_ms": round(step_ms, 4)}
    saved = 0.0
    groups = sizes.to(dev, torch.int32)
    for name, n, k in (("fc1", 2 * F, H), ("fc2", H, F)):  # dW1 [G, 2F, H] from dY1^T, X; dW2 [G, H, F] from dY2^T, Z
        realigning, aligned, bits = wgrad_pair(groups, n, k, gen, iters)
        row[f"{name}_wgrad_realigning_ms"] = round(realigning, 4)
        row[f"{name}_wgrad_aligned_ms"] = round(aligned, 4)
        row[f"{name}_aligned_bitexact"] = bits
        saved += realigning - aligned
    row["projected_ms"] = round(step_ms - saved, 4)
    te_fp8, _ = bml.TE_REPORTED[(model, G, M)]
    row["te_fp8_ms_reported"] = te_fp8
    row["speedup_vs_te_fp8_reported"] = round(te_fp8 / step_ms, 4)
    row["projected_speedup_vs_te_fp8_reported"] = round(te_fp8 / row["projected_ms"], 4)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    for model, G, M, seed in bml.te_rows():
        row = run_row(model, G, M, seed, args.iters)
        rows.append(row)
        print(f"{model:>14} G={G:3d} M={M:6d}: step {row['step_ms']:.3f} ms, "
              f"wgrad fc1 {row['fc1_wgrad_realigning_ms']:.3f} -> {row['fc1_wgrad_aligned_ms']:.3f}, "
              f"fc2 {row['fc2_wgrad_realigning_ms']:.3f} -> "
              f"{row['fc2_wgrad_aligned_ms']:.3f} (bits {row['fc1_aligned_bitexact'] and row['fc2_aligned_bitexact']})"
              f", projected {row['projected_ms']:.3f} ms; vs TE FP8 x{row['speedup_vs_te_fp8_reported']:.2f} -> "
              f"x{row['projected_speedup_vs_te_fp8_reported']:.2f}", flush=True)
    summary = {
        "min_vs_te_fp8_reported": min(r["speedup_vs_te_fp8_reported"] for r in rows),
        "projected_min_vs_te_fp8_reported": min(r["projected_speedup_vs_te_fp8_reported"] for r in rows),
        "geomean_vs_te_fp8_reported": bml.geomean([r["speedup_vs_te_fp8_reported"] for r in rows]),
        "projected_geomean_vs_te_fp8_reported": bml.geomean([r["projected_speedup_vs_te_fp8_reported"] for r in rows]),
        "all_aligned_bitexact": all(r["fc1_aligned_bitexact"] and r["fc2_aligned_bitexact"] for r in rows),
    }
    print("summary:", {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "project_layer_aligned_wgrad", "commit": common.git_commit(),
                       "gpu": torch.cuda.get_device_name(), "ceilings": ceilings,
                       "command": "python benchmarks/project_layer_aligned_wgrad.py", "rows": rows,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
