#!/usr/bin/env bash
# Lab (one call): build; the layer benchmarks of issue 52's deferral and 54's W^T in backward on a quiet machine;
# then Apex built in the background while named GPU tests run verbosely; then the Apex recipe test. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/bench"
t0=$(date +%s); DEADLINE=${DEADLINE:-585}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
stamp() { echo "$1 ($(( $(date +%s) - t0 )) s)"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
stamp built
bench() {  # $1: extra option; the timed runs go first, on a quiet machine
  timeout 70 python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 $1 --out "$OUT/bench/${1:-plain}" \
    > "$OUT/bench/log${1// /}.txt" 2>&1; stamp "bench '$1' rc=$?"; tail -8 "$OUT/bench/log${1// /}.txt"
}
bench ""; bench "--defer-wgrad"
(MAX_JOBS=10 bash .apex/build_apex.sh > "$OUT/apex_build.log" 2>&1; stamp "apex build rc=$?") &
bench "--transpose-in-backward"  # its peak memory is the point; its times share the CPU with Apex's build
timeout 90 python3 -m pytest -v -p no:cacheprovider --tb=short "tests/test_autograd.py::test_torch_compile_forward" \
  tests/test_transposed_weight.py tests/test_weight_cache.py tests/test_weight_cache_collectives.py \
  tests/test_weight_cache_collectives_gpu.py tests/test_wgrad_deferral.py tests/test_state_dict_layouts.py \
  > "$OUT/tail.log" 2>&1; stamp "tail tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/tail.log" | tail -8
timeout $(( $(left) - 90 )) python3 -m pytest -v -p no:cacheprovider --tb=short -m recipe_run \
  -k deferred tests/test_mcore_gpu.py > "$OUT/recipe.log" 2>&1
stamp "recipe tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/recipe.log" | tail -8
wait
[ -f /tmp/apex/env.sh ] || { tail -20 "$OUT/apex_build.log"; exit 1; }
source /tmp/apex/env.sh
timeout $(( $(left) - 3 )) python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_apex_gpu.py > "$OUT/apex_tests.log" 2>&1
stamp "apex tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/apex_tests.log" | tail -6
