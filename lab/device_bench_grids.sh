#!/usr/bin/env bash
# Lab: one device call that builds the extension and DeepGEMM, then runs the three GEMM benchmark grids
# (K-grouped, M-grouped, the layer) with DeepGEMM beside ours. JSON + PNG + logs packed in $OUT/res.tgz
# (only a few files come back from a device call).
#   MEGATRON_TMA_COMMIT=<sha> bash lab/device_bench_grids.sh       (carry .dg .whl)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/res"
t0=$(date +%s)
LOGS=$OUT/res source lab/device_setup.sh || exit 1
echo "builds done $(( $(date +%s) - t0 )) s"
for b in ${BENCHES:-k_grouped:230 m_grouped:150 mlp_layer:150}; do
  name=${b%%:*}; lim=${b#*:}; t1=$(date +%s)
  timeout $lim python3 benchmarks/bench_$name.py --out "$OUT/res" > "$OUT/res/bench_$name.log" 2>&1
  echo "bench $name rc=$? $(( $(date +%s) - t1 )) s"; grep -iE "summary|geomean|wrote" "$OUT/res/bench_$name.log" | tail -4
done
tar czf "$OUT/res.tgz" -C "$OUT" res && rm -rf "$OUT/res"
echo "total $(( $(date +%s) - t0 )) s"
