#!/usr/bin/env bash
# Lab (one call, <= 8 files back): build; the three qwen3 layer benchmarks (JSON + PNG each); the compile test alone
# with its traceback; the rest of the suite's tail; the recompute/W^T recipe test with what time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; t0=$(date +%s); DEADLINE=${DEADLINE:-300}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
stamp() { echo "$1 ($(( $(date +%s) - t0 )) s)"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
stamp built
for extra in plain --defer-wgrad --transpose-in-backward; do
  opt=$extra; [ "$extra" = plain ] && opt=""
  timeout 60 python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 $opt --out /tmp/b$extra \
    > /tmp/log.txt 2>&1; stamp "bench $extra rc=$?"; tail -3 /tmp/log.txt
  for f in /tmp/b$extra/*; do cp "$f" "$OUT/${extra#--}-$(basename "$f")"; done
done
timeout 40 python3 -m pytest -x -p no:cacheprovider --tb=long "tests/test_autograd.py::test_torch_compile_forward" \
  > "$OUT/tests.log" 2>&1; stamp "compile test rc=$?"
timeout 70 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_weight_cache.py tests/test_weight_cache_collectives.py \
  tests/test_weight_cache_collectives_gpu.py tests/test_wgrad_deferral.py tests/test_state_dict_layouts.py \
  >> "$OUT/tests.log" 2>&1; stamp "tail tests rc=$?"; tail -3 "$OUT/tests.log"
timeout $(( $(left) - 3 )) python3 -m pytest -v -p no:cacheprovider --tb=short -m recipe_run -k recompute \
  tests/test_mcore_gpu.py >> "$OUT/tests.log" 2>&1; stamp "recipe recompute rc=$?"; tail -2 "$OUT/tests.log"
