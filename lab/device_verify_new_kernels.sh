#!/usr/bin/env bash
# Lab (one call, <= 8 files back): what the last stop built and could not run on a GPU. Build; the GPU tests of the transpose kernel, the refresh kernel and
# StepRefreshedWeights in CUDA graphs, the sync-free deferral, the compile test; the qwen3 layer benchmarks at 4
# micro-batches plain, with --release-bf16-weights, --defer-wgrad, --transpose-in-backward (JSON each); then the 128x128 quantizer tests.
DEADLINE=${DEADLINE:-330}
source lab/device_setup.sh
timeout 70 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_weight_refresh_gpu.py \
  "tests/test_autograd.py::test_torch_compile_forward" "tests/test_mlp_gpu.py::test_deferred_weight_gradients_never_sync" \
  "tests/test_mlp_gpu.py::test_deferred_weight_gradients_over_micro_batches" \
  "tests/test_quant_gpu.py::test_transpose_128x128_is_the_quantizers_transposed_copy" \
  "tests/test_quant_gpu.py::test_transpose_128x128_refuses_what_it_cannot_read" \
  "tests/test_quant_gpu.py::test_128x128_refresh_writes_or_skips_on_the_device" tests/test_released_weights.py \
  > "$OUT/tests.log" 2>&1; stamp "focused tests rc=$?"; tail -4 "$OUT/tests.log"
bench() {  # $1: a name, then the options; JSON back as <name>-<file>
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 "$@" --out "/tmp/b$name" \
    > /tmp/log.txt 2>&1; stamp "bench $name rc=$?"; grep -E "^ qwen3" /tmp/log.txt | head -8; tail -2 /tmp/log.txt | cut -c1-400
  for f in /tmp/b$name/*.json; do cp "$f" "$OUT/$name-$(basename "$f")"; done
}
bench graphs 150         # the eager micro-batch step and its CUDA graphs (re-quantizing, step-refreshed, BF16)
[ "$(left)" -gt 45 ] && bench release 45 --release-bf16-weights --no-graphs
[ "$(left)" -gt 45 ] && bench defer 40 --defer-wgrad
[ "$(left)" -gt 45 ] && bench transpose 40 --transpose-in-backward --no-graphs
[ "$(left)" -gt 15 ] && timeout $(( $(left) - 3 )) python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
  tests/test_quant_gpu.py -k 128x128 tests/test_mlp_gpu.py >> "$OUT/tests.log" 2>&1
stamp "rest rc=$?"; tail -3 "$OUT/tests.log"
