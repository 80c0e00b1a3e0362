"""Summary of an A/B timing run: a JSON-lines file of {"variant", "round", METRIC: {row: value}} written by
tune_ffma_hints.sh, ab_builds.sh ("tflops") or ab_quant.sh ("tbps"); higher is better. Prints each variant's per-row median over its processes and its geomean
against the baseline variant, and the baseline's process-to-process spread per row.

    python lab/ab_summary.py TIMES.jsonl BASELINE
"""
import json
import math
import statistics
import sys


def main(path, baseline):
    by = {}
    for line in open(path):
        run = json.loads(line)
        (metric,) = (key for key in run if key not in ("variant", "round"))
        if run[metric]:
            by.setdefault(run["variant"], []).append(run[metric])
    if baseline not in by:
        sys.exit(f"no timings of the baseline variant {baseline!r} in {path}")
    rows = list(by[baseline][0])
    med = {v: {r: statistics.median(t[r] for t in ts) for r in rows} for v, ts in by.items()}
    print(f"{metric}, median over processes (n); geomean vs {baseline}; spread = max/min of {baseline} per row")
    print(" " * 22 + " ".join(f"{r:>22s}" for r in rows))
    for v, m in med.items():
        g = math.exp(sum(math.log(m[r] / med[baseline][r]) for r in rows) / len(rows))
        print(f"{v:18s} n={len(by[v])} " + " ".join(f"{m[r]:22.4g}" for r in rows) + f"  x{g:.4f}")
    spread = [max(t[r] for t in by[baseline]) / min(t[r] for t in by[baseline]) for r in rows]
    print(f"{baseline} spread per row: " + " ".join(f"{s:.3f}" for s in spread))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
