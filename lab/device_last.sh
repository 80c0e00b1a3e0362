#!/usr/bin/env bash
# Lab (one short call): the expert MLP's GPU tests on the planned step, then the release grid's Qwen3 and
# DeepSeek-V3 rows (lab/device_grid_release.sh without its cached and M-grouped parts), for a call that must fit a
# few minutes of device time.
DEADLINE=${DEADLINE:-200}
source lab/device_call.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_mlp_gpu.py \
  tests/test_weight_refresh_gpu.py tests/test_released_weights.py tests/test_permutation_gpu.py \
  tests/test_transposed_weight.py > "$OUT/tests.log" 2>&1; stamp "tests rc=$?"; tail -2 "$OUT/tests.log"
bench_layer release 200 --release-bf16-weights --models qwen3_30b_a3b deepseek_v3
