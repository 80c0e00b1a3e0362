"""Sum an ncu source page (SASS, CSV) per opcode: where a kernel's warp-stall samples and issued instructions go.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python lab/ncu_sass_summary.py sass.csv [--top 25]

Every numeric column is summed per opcode (the mnemonic without modifiers or predicate); the table shows the
columns with the largest totals, as a share of each column's total, opcodes ordered by the first column shown.
"""
import argparse
import csv
import re
from collections import defaultdict


def opcode(sass):
    text = re.sub(r"^\s*@!?U?P\w+\s+", "", sass.strip())
    return text.split(" ")[0].split(".")[0] if text else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25, help="opcodes shown")
    ap.add_argument("--columns", type=int, default=8, help="numeric columns shown")
    args = ap.parse_args()
    lines = open(args.csv, newline="").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith("Address"))
    rows = list(csv.DictReader(lines[start:]))
    src = next(c for c in rows[0] if c.strip() == "Source")
    sums, totals = defaultdict(lambda: defaultdict(float)), defaultdict(float)
    for r in rows:
        op = opcode(r[src])
        for c, v in r.items():
            if c in ("Address", src) or v in (None, ""):
                continue
            try:
                x = float(v.replace(",", ""))
            except ValueError:
                continue
            sums[op][c] += x
            totals[c] += x
    cols = sorted((c for c in totals if totals[c] > 0), key=lambda c: -totals[c])[: args.columns]
    if not cols:
        raise SystemExit("no numeric columns with samples in " + args.csv)
    print(f"{len(rows)} SASS lines; totals: " + "; ".join(f"{c} = {totals[c]:.0f}" for c in cols))
    print(f"{'opcode':12s}" + "".join(f"{c[:22]:>24s}" for c in cols))
    for op in sorted(sums, key=lambda o: -sums[o][cols[0]])[: args.top]:
        print(f"{op:12s}" + "".join(f"{100 * sums[op][c] / totals[c]:23.1f}%" for c in cols))


if __name__ == "__main__":
    main()
