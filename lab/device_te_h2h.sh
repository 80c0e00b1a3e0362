#!/usr/bin/env bash
# One device call after the TE install (scripts/te_device_steps.md calls 1-5): the wheels, the kernels, the new
# K-grouped tests, the head-to-head (three modes of 300 steps in one launch; H2H_EXTRA: more recipe options, e.g.
# "--micro-batch-size 8 --steps 100"; COUNTS_AB=1: then megatron_tma's modes with --device-token-counts), then the TE
# tests with the time left.
# Logs and the head-to-head's JSON/PNG go to $OUT.
set -uo pipefail
T0=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.te_site:$PWD/.site:$PWD NVTE_FRAMEWORK=pytorch MEGATRON_TMA_COMMIT=${COMMIT:-unknown}
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "[$(( $(date +%s) - T0 ))s] built"
timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_k_grouped_gpu.py > $OUT/k_grouped.log 2>&1; tail -3 $OUT/k_grouped.log
grep -E "^E  " $OUT/k_grouped.log | head -8
echo "[$(( $(date +%s) - T0 ))s] head-to-head"
timeout ${H2H_S:-400} torchrun --standalone --nproc-per-node 1 recipes/moe_gpt.py --preset dsv3-like \
  --transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise \
  --modes unpadded te bf16 --nondeterministic --profile-step 200 ${H2H_EXTRA:-} --out $OUT > $OUT/h2h.log 2>&1
echo "h2h rc=$?"; grep -E "step +(0|100|200|299) |head|speedup|tokens|peak|Error|error" $OUT/h2h.log | grep -v Warning | tail -30
# COUNTS_AB=1: megatron_tma's two modes again with the token counts kept on the GPU (--device-token-counts), same
# steps and data, into $OUT/counts; compare its step times and head_to_head block with the run above (two results:
# --compare cannot merge them, their configs differ).
if [ "${COUNTS_AB:-0}" = 1 ]; then
  echo "[$(( $(date +%s) - T0 ))s] head-to-head, --device-token-counts"
  mkdir -p $OUT/counts
  timeout ${H2H_S:-400} torchrun --standalone --nproc-per-node 1 recipes/moe_gpt.py --preset dsv3-like \
    --transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise \
    --modes unpadded bf16 --nondeterministic --profile-step 200 ${H2H_EXTRA:-} --device-token-counts \
    --out $OUT/counts > $OUT/h2h_counts.log 2>&1
  echo "h2h counts rc=$?"; grep -E "token counts on the GPU|step +(0|100|200|299) |tokens|Error|error" $OUT/h2h_counts.log \
    | grep -v Warning | tail -12
fi
echo "[$(( $(date +%s) - T0 ))s] TE tests"
t=$(left ${TOTAL_S:-570}); [ "$t" -gt 30 ] && timeout $t python3 -m pytest -q -rfEs -p no:cacheprovider --timeout=300 tests/test_te_gpu.py \
  tests/test_mcore_megatron_lm.py "tests/test_mcore_gpu.py::test_recipe_resumes_bit_exact_after_a_kill" > $OUT/te_tests.log 2>&1
tail -12 $OUT/te_tests.log
echo "[$(( $(date +%s) - T0 ))s] done"
