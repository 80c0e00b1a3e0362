"""K-grouped (weight-gradient) FP8 GEMM benchmark: dW [G, N, K] from M tokens for each forward configuration
of the m-grouped benchmark, accumulating into FP32 (Megatron's main_grad). Each row is judged against its own
roofline measured in the same run: max(2MNK / dense FP8 rate, bytes / copy bandwidth).

Methods: ours (accumulate=True), padded_path (FP8 operand columns gathered into 128-aligned groups + the same
kernel), padded_gemm (that kernel alone), torch_rowwise (2d-2d torch._scaled_grouped_mm, groups padded to 16
and non-empty as it requires), bf16 (2d-2d torch._grouped_mm), dense_cublas (torch._scaled_mm, same FLOPs).

    python benchmarks/bench_k_grouped.py [--quick] [--out DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_m_grouped import DISTS, MORE, TABLE, geomean, rowwise_fp8  # noqa: E402

from megatron_tma import quant  # noqa: E402
from megatron_tma.gemm import k_grouped_fp8_gemm  # noqa: E402
from megatron_tma.groups import make_group_sizes  # noqa: E402


def padded_token_index(sizes, align, dev):
    """Source column of every padded column (-1 for padding): test/benchmark bookkeeping on the host."""
    idx = []
    start = 0
    for s in sizes.tolist():
        p = -(-s // align) * align
        idx += list(range(start, start + s)) + [-1] * (p - s)
        start += s
    return torch.tensor(idx, dtype=torch.int64, device=dev)


def roofline_ms(G, M, N, K, ceilings):
    """The row's roofline: max(2MNK / dense FP8 rate, bytes / copy bandwidth), bytes = both FP8 operands, their
    token-block scales, and the FP32 output read and written (accumulate into main_grad)."""
    flops = 2.0 * M * N * K
    nbytes = (N + K) * M + (M // 128 + G) * (N + K) * 4 + 2 * G * N * K * 4
    return max(flops / (ceilings["dense_fp8_tflops"] * 1e9), nbytes / (ceilings["copy_tbps"] * 1e9))


def run_config(G, M, N, K, dist, seed, iters, ceilings):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    sizes = make_group_sizes(M, G, dist, seed)
    groups = sizes.to(dev)
    x = torch.randn(M, K, generator=gen, device=dev).bfloat16()
    dy = torch.randn(M, N, generator=gen, device=dev).bfloat16()
    xt, xs = quant.quantize_grouped_128x1(x, groups)
    dyt, dys = quant.quantize_grouped_128x1(dy, groups)
    main_grad = torch.zeros(G, N, K, device=dev)
    row = {"G": G, "M": M, "N": N, "K": K, "dist": dist, "seed": seed,
           "empty_groups": int((sizes == 0).sum()), "min_group": int(sizes.min())}
    flops = 2.0 * M * N * K
    row["roofline_ms"] = round(roofline_ms(G, M, N, K, ceilings), 5)

    fns = {"ours": lambda: k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=main_grad, accumulate=True)}
    # padded layout: the same quantized columns gathered into 128-aligned groups (zero columns as padding)
    psizes = -(-sizes // 128) * 128
    pidx = padded_token_index(sizes, 128, dev)
    mp = int(psizes.sum())
    pgroups = psizes.to(dev)
    valid = pidx >= 0
    src = pidx.clamp(min=0)

    def pad_cols(t):
        out = torch.zeros(t.shape[0], mp, dtype=t.dtype, device=dev)
        out.view(torch.uint8)[:, :] = torch.where(valid, t.view(torch.uint8)[:, src], 0)
        return out

    xs_p = torch.zeros(mp // 128 + G, K, device=dev)
    dys_p = torch.zeros(mp // 128 + G, N, device=dev)
    nb = int((-(-sizes // 128)).sum())
    xs_p[:nb] = xs[:nb]
    dys_p[:nb] = dys[:nb]
    xt_p, dyt_p = pad_cols(xt), pad_cols(dyt)
    fns["padded_gemm"] = lambda: k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups, out=main_grad, accumulate=True)

    def padded_path():
        a, b = pad_cols(xt), pad_cols(dyt)
        return k_grouped_fp8_gemm(b, dys_p, a, xs_p, pgroups, out=main_grad, accumulate=True)

    fns["padded_path"] = padded_path
    # torch 2d-2d grouped GEMMs want groups aligned to 16 and non-empty
    s16 = torch.clamp(-(-sizes // 16) * 16, min=16)  # an empty group gets 16 zero tokens
    m16 = int(s16.sum())
    offs16 = torch.cumsum(s16, 0).to(torch.int32).to(dev)

    def gather_rows16(t):
        out = torch.zeros(m16, t.shape[1], dtype=t.dtype, device=dev)
        pos, start16 = [], 0
        for g, s in enumerate(sizes.tolist()):
            pos.append(torch.arange(start16, start16 + s, device=dev))
            start16 += int(s16[g])
        out[torch.cat(pos)] = t
        return out

    x16, dy16 = gather_rows16(x), gather_rows16(dy)
    xr, xr_s = rowwise_fp8(x16.t().contiguous())     # [K, M16] row-wise over tokens
    dyr, dyr_s = rowwise_fp8(dy16.t().contiguous())  # [N, M16]
    fns["torch_rowwise"] = lambda: torch._scaled_grouped_mm(dyr, xr.t(), dyr_s.repeat(G), xr_s.repeat(G), offs=offs16,
                                                            out_dtype=torch.bfloat16)
    fns["bf16"] = lambda: torch._grouped_mm(dy16.t(), x16, offs=offs16)
    a_d = dyt.as_strided((N, M), (dyt.stride(0), 1)).contiguous()
    b_d = xt.as_strided((K, M), (xt.stride(0), 1)).contiguous().t()
    one = torch.ones((), device=dev)
    fns["dense_cublas"] = lambda: torch._scaled_mm(a_d, b_d, one, one, out_dtype=torch.bfloat16)

    common.time_methods(row, fns, flops, iters)
    ours = k_grouped_fp8_gemm(dyt, dys, xt, xs, groups)
    row["bitexact"] = bool(torch.equal(ours, k_grouped_fp8_gemm(dyt_p, dys_p, xt_p, xs_p, pgroups)))
    row["ours_over_roofline"] = round(row["ours_ms"] / row["roofline_ms"], 3)
    for base in ("padded_path", "torch_rowwise"):
        if f"{base}_ms" in row:
            row[f"speedup_vs_{base}"] = round(row[f"{base}_ms"] / row["ours_ms"], 4)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [(c, "paper") for c in TABLE] if args.quick else [(c, d) for c in TABLE + MORE for d in DISTS]
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    for i, ((G, M, N, K), dist) in enumerate(configs):
        row = run_config(G, M, N, K, dist, 2000 + i, args.iters, ceilings)
        rows.append(row)
        print(f"[{i + 1}/{len(configs)}] G={G} M={M} N={N} K={K} {dist}: ours {row['ours_ms']} ms "
              f"({row['ours_over_roofline']}x roofline), bitexact={row['bitexact']}", flush=True)
    summary = {
        "max_ours_over_roofline": max(r["ours_over_roofline"] for r in rows),
        "geomean_vs_padded_path": geomean([r.get("speedup_vs_padded_path") for r in rows]),
        "geomean_vs_torch_rowwise": geomean([r.get("speedup_vs_torch_rowwise") for r in rows]),
        "all_bitexact": all(r["bitexact"] for r in rows),
    }
    path = common.write_result("k_grouped", rows, ceilings, command="python benchmarks/bench_k_grouped.py"
                               + (" --quick" if args.quick else ""), extra={"summary": summary}, out_dir=args.out)
    plot(rows, path.replace(".json", ".png"), args.out)
    print(f"\n{'G':>3} {'M':>6} {'N':>5} {'K':>5} {'dist':>8} {'ours_ms':>8} {'roof_ms':>8} {'x_roof':>6} "
          f"{'padded':>8} {'rowwise':>8} {'bf16':>8}  exact")
    for r in rows:
        print(f"{r['G']:>3} {r['M']:>6} {r['N']:>5} {r['K']:>5} {r['dist']:>8} {r['ours_ms']:8.3f} {r['roofline_ms']:8.3f} "
              f"{r['ours_over_roofline']:6.2f} {r.get('padded_path_ms', float('nan')):8.3f} "
              f"{r.get('torch_rowwise_ms', float('nan')):8.3f} {r.get('bf16_ms', float('nan')):8.3f}  {r['bitexact']}")
    print("summary:", summary)
    print(f"wrote {path}")


def plot(rows, png, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(10, 0.55 * len(rows)), 5))
    xs = list(range(len(rows)))
    ax.bar(xs, [r["ours_over_roofline"] for r in rows], 0.6, label="ours / roofline")
    ax.axhline(1.5, color="r", lw=0.8, ls="--", label="target 1.5x")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"G{r['G']} M{r['M'] // 1024}k\nN{r['N']} K{r['K']}\n{r['dist']}" for r in rows], fontsize=6)
    ax.set_ylabel("time / roofline (lower is better)")
    ax.set_title("K-grouped FP8 wgrad (accumulate into FP32) on H200")
    ax.legend()
    common.save_figure(fig, png, out_dir)


if __name__ == "__main__":
    main()
