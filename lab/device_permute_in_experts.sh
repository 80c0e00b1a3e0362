# Device call: build, the permutation's GPU tests, the rest of the GPU suite after tests/test_permutation_gpu.py
# (the first call stopped there), then one launch of the recipe without TE: unpadded (permuting in the experts) vs
# bf16 experts, 300 steps. Carry [".whl"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD MEGATRON_TMA_COMMIT=${COMMIT:-wip}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
rest=$(ls tests/test_*.py | awk '$0 >= "tests/test_permutation_gpu.py"')
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m "not recipe_run" $rest > $OUT/suite_rest.log 2>&1
echo "suite (from test_permutation_gpu) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/suite_rest.log | tail -12
echo "at $(( $(date +%s) - t0 )) s"
timeout 330 torchrun --standalone --nproc-per-node 1 recipes/moe_gpt.py --preset dsv3-like --micro-batch-size 8 \
  --permute-in-experts --modes unpadded bf16 --nondeterministic --steps 300 --profile-step 280 --out $OUT/recipe \
  > $OUT/recipe.log 2>&1
echo "recipe rc=$?"; grep -E "experts permute|speedup|ms_per_step_median|tokens_per_s|peak_mb|final_window_mean" $OUT/recipe.log | tail -14
echo "at $(( $(date +%s) - t0 )) s"
