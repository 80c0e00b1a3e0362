"""Every M-grouped tile on the expert MLP's own GEMM shapes: forward fc1 (N = 2F, K = H) and fc2 (N = H, K = F),
dgrad of fc2 (N = F, K = H) and of fc1 (N = H, K = 2F), for bench_mlp_layer's models, token counts and size
distributions. The paper's grid (bench_m_grouped) has K >= 3072 only; the layer adds K = 768-2048 and N = 768-1536,
where a tile's fixed costs weigh more. This is the evidence for the default tile
(csrc/include/megatron_tma/scheduler/m_grouped_tile_choice.h) on those shapes.

    python lab/time_layer_gemm_tiles.py [--models qwen3_30b_a3b,deepseek_v3] [--tokens 8192,32768]
                                               [--dists paper] [--iters 20] [--out FILE.json]

Methods, timed interleaved in one process (docs/design.md §5 protocol): `default` (the tile the launcher picks, named in
`default_tile`) and each forced tile 128x128, 128x192, 192x128. Prints one line per GEMM and a per-model summary:
the default's time against the best forced tile's.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import common  # noqa: E402
from bench_m_grouped import make_inputs  # noqa: E402
from bench_mlp_layer import MODELS  # noqa: E402

import torch  # noqa: E402

from megatron_tma.gemm import m_grouped_fp8_gemm, m_grouped_tile  # noqa: E402

TILES = {"128x128": (128, 128), "128x192": (128, 192), "192x128": (192, 128)}


def layer_gemms(H, F):
    """(name, N, K) of the layer's four M-grouped GEMMs."""
    return [("fc1_fwd", 2 * F, H), ("fc2_fwd", H, F), ("fc2_dgrad", F, H), ("fc1_dgrad", H, 2 * F)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--dists", default="paper")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="", help="also write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    seed = 3000
    for model in args.models.split(","):
        H, F, gs = MODELS[model]
        for G in gs:
            for M in (int(t) for t in args.tokens.split(",")):
                for dist in args.dists.split(","):
                    for name, N, K in layer_gemms(H, F):
                        seed += 1
                        _, groups, _, _, aq, a_s, wq, ws = make_inputs(G, M, N, K, dist, seed)
                        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
                        fns = {"default": lambda: m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out)}
                        for t, (bm, bn) in TILES.items():
                            fns[t] = (lambda bm=bm, bn=bn:
                                      m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out, block_m=bm, block_n=bn))
                        row = {"model": model, "G": G, "M": M, "dist": dist, "gemm": name, "N": N, "K": K,
                               "default_tile": "%dx%d" % m_grouped_tile(M, N, G)}
                        common.time_methods(row, fns, 2.0 * M * N * K, args.iters)
                        best = min(TILES, key=lambda t: row.get(f"{t}_ms", float("inf")))
                        row["best_tile"] = best
                        row["default_vs_best"] = round(row[f"{best}_ms"] / row["default_ms"], 4)
                        rows.append(row)
                        print(f"{model:14s} G={G:3d} M={M:5d} {dist:6s} {name:9s} N={N:5d} K={K:5d} default "
                              f"{row['default_tile']:7s} {row['default_tflops']:7.1f} TFLOPS | "
                              + " ".join(f"{t} {row.get(f'{t}_tflops', float('nan')):7.1f}" for t in TILES)
                              + f" | best {best}, default/best x{row['default_vs_best']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "layer_gemm_tiles", "gpu": torch.cuda.get_device_name(),
                       "commit": common.git_commit(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
