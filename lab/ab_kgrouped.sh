#!/usr/bin/env bash
# Lab: A/B of compile-time variants of the K-grouped kernel in one device call. Each variant is the working tree
# built with extra nvcc flags (MEGATRON_TMA_NVCC_EXTRA) in its own copy, all in parallel; then the probe times
# every variant in alternating processes (rotated order) and a summary prints per-variant medians.
#   VARIANTS="base:|x:-DSOME_MACRO=1" ROUNDS=3 SHAPES=... DISTS=... bash lab/ab_kgrouped.sh
# The variants measured on 2026-12-02 (macros MEGATRON_TMA_KG_ZERO_PER_WG, _GROUP_MINOR, _PREFETCH_SCALES) live in
# commits 28d18b8 and de956a0; their results in lab/results/kgrouped_ab_*.txt and benchmarks/NOTES.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/ab; mkdir -p "$D"
IFS='|' read -r -a variants <<< "${VARIANTS:-base:}"
n=${#variants[@]}; jobs=$(( 16 / n )); [ $jobs -lt 2 ] && jobs=2
names=()
for v in "${variants[@]}"; do
  name=${v%%:*}; flags=${v#*:}; names+=("$name")
  dst=/tmp/ab/$name; rm -rf "$dst"; mkdir -p "$dst"
  cp -r csrc megatron_tma scripts benchmarks lab setup.py pyproject.toml "$dst"/
  ( cd "$dst" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$jobs MEGATRON_TMA_NVCC_EXTRA="$flags" \
      python3 setup.py build_ext --inplace > "$D/build_$name.log" 2>&1 && echo "built $name" || { echo "build $name FAILED"; tail -20 "$D/build_$name.log"; } ) &
done
wait
for r in $(seq 1 "${ROUNDS:-3}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${names[$(( (i + r) % n ))]}
    ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:${PYTHONPATH:-} timeout 300 python3 lab/kgrouped_probe.py --no-check --time \
        --iters "${ITERS:-10}" --shapes "${SHAPES:-8:16384:4096:4096,32:8192:4096:7168,8:32768:4096:7168}" \
        --dists "${DISTS:-balanced,paper}" ) 2>&1 | grep RESULT | sed "s/^RESULT/$name/" >> "$D/times.txt"
  done
done
python3 - "$D/times.txt" <<'PY'
import re, statistics, sys
from collections import defaultdict
t = defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) (G=.*?): acc ([\d.]+) ms .*? bf16 ([\d.]+) .*? dense ([\d.]+)", line)
    if m:
        t[(m.group(2), m.group(1))].append((float(m.group(3)), float(m.group(4)), float(m.group(5))))
rows = sorted({k[0] for k in t}); names = []
for k in t:
    if k[1] not in names: names.append(k[1])
for row in rows:
    base = None
    out = []
    for nm in names:
        v = t.get((row, nm))
        if not v: continue
        acc = statistics.median(x[0] for x in v); bf = statistics.median(x[1] for x in v); dn = statistics.median(x[2] for x in v)
        if base is None: base = (acc, bf)
        out.append(f"{nm}: acc {acc:.3f} ({base[0]/acc:.3f}x) bf16 {bf:.3f} ({base[1]/bf:.3f}x) dense {dn:.3f}")
    print(row, " | ".join(out))
PY
