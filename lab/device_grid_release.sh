#!/usr/bin/env bash
# Lab (one call, <= 8 files back): the one-pass layer grid with the FP8 weights written from the FP32 masters
# (--release-bf16-weights, the optimizer's write in every twin's step: issues 52 and 54's layer rows; its first run,
# at a49a88a, ran out of memory from its seventh row on: released layers were never freed, fixed since), the same
# with cached weights (issue 54's <= x0.9 target), then the M-grouped grid's worst row against the padded GEMM
# (lab/device_mgrouped_row.sh) in what time is left. Pass MEGATRON_TMA_COMMIT (the device's git does not know the tree).
DEADLINE=${DEADLINE:-560}
BENCH_LOGS=0  # (<= 8 files back: the tables are echoed, the JSONs hold the rows)
source lab/device_call.sh
# the planned step on the GPU: the expert MLP's and its neighbours' GPU tests (graphs, no host sync, empty
# groups, refreshed and released weights, the permutation, Megatron's experts); TESTS=0 skips them
# (TESTS=short: the expert MLP's and the released weights' only)
TEST_FILES="tests/test_mlp_gpu.py tests/test_released_weights.py"
[ "${TESTS:-1}" = 1 ] && TEST_FILES="$TEST_FILES tests/test_weight_refresh_gpu.py tests/test_permutation_gpu.py \
  tests/test_mcore_gpu.py tests/test_transposed_weight.py"
[ "${TESTS:-1}" != 0 ] && { timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE $TEST_FILES \
  > "$OUT/tests.log" 2>&1; stamp "tests rc=$?"; tail -2 "$OUT/tests.log"; }
# (GRID_MODELS: only these models' rows, e.g. qwen3_30b_a3b, when the call is short)
bench_layer release 200 --release-bf16-weights ${GRID_MODELS:+--models $GRID_MODELS}
# what is alive at each twin's peak (lab/probe_layer_memory.py), inputs handed over as in a model
for row in "qwen3_30b_a3b --G 32 --M 32768" "deepseek_v3 --G 8 --M 8192"; do
  [ "$(left)" -gt 60 ] && timeout 40 python3 lab/probe_layer_memory.py --model $row --release-bf16-weights \
    --handed-inputs >> "$OUT/mem.log" 2>&1
done; stamp "memory probe"; grep -E "step peak" "$OUT/mem.log"
bench_layer cached 150 --release-bf16-weights --cached-weights
# issue 54's third option beside it: W only held, W^T made in each backward
bench_layer cached-wt 110 --release-bf16-weights --cached-weights --transpose-in-backward \
  --models qwen3_30b_a3b deepseek_v3
[ "$(left)" -gt 100 ] && DEADLINE=$(( $(left) - 5 )) DEVICE_REBUILD=0 bash lab/device_mgrouped_row.sh
