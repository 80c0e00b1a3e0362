#!/usr/bin/env bash
# Lab (one call, <= 8 files back): build; the GPU tests of the transpose kernel, the refresh kernel and
# StepRefreshedWeights in CUDA graphs, the sync-free deferral, the compile test; the qwen3 layer benchmarks with
# --defer-wgrad and --transpose-in-backward (JSON + PNG each); then the rest of the touched GPU files with what is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; t0=$(date +%s); DEADLINE=${DEADLINE:-240}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
stamp() { echo "$1 ($(( $(date +%s) - t0 )) s)"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 \
  || { tail -40 /tmp/build.log; exit 1; }
stamp built
timeout 80 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_weight_refresh_gpu.py \
  "tests/test_autograd.py::test_torch_compile_forward" tests/test_ops.py tests/test_transposed_weight.py \
  tests/test_weight_refresh.py > "$OUT/tests.log" 2>&1; stamp "focused tests rc=$?"; tail -4 "$OUT/tests.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_quant_gpu.py -k "128x128" \
  >> "$OUT/tests.log" 2>&1; stamp "128x128 tests rc=$?"; tail -3 "$OUT/tests.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_mlp_gpu.py \
  -k "deferred or transposed or no_host_sync or cuda_graph" >> "$OUT/tests.log" 2>&1
stamp "mlp tests rc=$?"; tail -3 "$OUT/tests.log"
for extra in --defer-wgrad --transpose-in-backward; do
  timeout 45 python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 $extra --out /tmp/b$extra \
    > /tmp/log.txt 2>&1; stamp "bench $extra rc=$?"; grep -E "^ qwen3" /tmp/log.txt | head -8; tail -2 /tmp/log.txt
  for f in /tmp/b$extra/*; do cp "$f" "$OUT/${extra#--}-$(basename "$f")"; done
done
[ "$(left)" -gt 20 ] && timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
  tests/test_quant_gpu.py tests/test_mlp_gpu.py tests/test_compile_fullgraph.py >> "$OUT/tests.log" 2>&1
stamp "rest rc=$?"; tail -3 "$OUT/tests.log"
