#!/usr/bin/env bash
# Lab: one short device call that builds, times the K-grouped grid, the quantizers and the layer, then runs the
# GPU tests touched last. Results under $OUT/res (copied to benchmarks/results/ by hand, with the commit).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/res"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; grep "\[megatron_tma\]" "$OUT/build.log" | head -3
for b in k_grouped quant mlp_layer:--quick; do
  name=${b%%:*}; extra=""; [ "$b" != "$name" ] && extra=${b#*:}
  t0=$(date +%s); timeout 200 python3 benchmarks/bench_$name.py $extra --out "$OUT/res" > "$OUT/res/$name.log" 2>&1
  echo "bench $name $extra rc=$? $(( $(date +%s) - t0 )) s"; grep -E "summary|wrote" "$OUT/res/$name.log" | tail -3
done
timeout 120 python3 -m pytest -q -x tests/test_gemm_fast_path_gpu.py tests/test_k_grouped_gpu.py tests/test_cli.py 2>&1 | tail -3
python3 -m megatron_tma --check | tail -4
