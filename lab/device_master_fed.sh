#!/usr/bin/env bash
# Lab (one call, <= 8 files back): build; the GPU tests of the master-fed FP8 weights (kernel, layer, ops), the
# compile test, the transpose kernel in backward; Megatron's optimizer writing them (recipe test); the layer benchmark
# with --release-bf16-weights and --transpose-in-backward (4 micro-batches); with GRID=1 the one-pass grid with the
# optimizer's write in every twin (released, then plain); then the dsv3-like preset graphed.
DEADLINE=${DEADLINE:-540}
source lab/device_call.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_released_weights.py tests/test_ops.py \
  "tests/test_autograd.py::test_torch_compile_forward" tests/test_transposed_weight.py \
  tests/test_quant_gpu.py -k "not (test_1x128 or grouped)" > "$OUT/tests.log" 2>&1
stamp "tests rc=$?"; tail -3 "$OUT/tests.log"
[ "$(left)" -gt 100 ] && { timeout $(( $(left) - 10 < 240 ? $(left) - 10 : 240 )) python3 -m pytest -q -p no:cacheprovider \
  --tb=short -rfE -m recipe_run -k "released_bf16 or plain-released or plain-graphed" tests/test_mcore_gpu.py > "$OUT/recipe.log" 2>&1
  stamp "recipe rc=$?"; tail -3 "$OUT/recipe.log"; }
bench() {  # $1: a name, $2: its limit, then the options; JSON back as <name>-<file>
  local name=$1 limit=$2; shift 2
  [ "$(left)" -lt $(( limit + 5 )) ] && { echo "no time for bench $name"; return; }
  timeout "$limit" python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 "$@" --out "/tmp/b$name" \
    > /tmp/log.txt 2>&1; stamp "bench $name rc=$?"; grep -E "^ qwen3" /tmp/log.txt | head -8
  for f in /tmp/b$name/*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name-$(basename "$f")"; done
}
bench release 60 --release-bf16-weights --no-graphs
bench transpose 60 --transpose-in-backward --no-graphs
# the one-pass grid with the optimizer's write in every twin's step: released FP8 weights written from the masters
# (issue 52's and 54's layer targets), then the plain FP8 path with the same write
[ "${GRID:-0}" = 1 ] && for opt in --release-bf16-weights --optimizer-write; do
  [ "$(left)" -lt 200 ] && break
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_mlp_layer.py --no-graphs $opt --out /tmp/grid$opt > /tmp/grid.log 2>&1
  stamp "grid $opt rc=$?"; tail -4 /tmp/grid.log | cut -c1-400
  for f in /tmp/grid$opt/*.json; do [ -f "$f" ] && cp "$f" "$OUT/grid$opt-$(basename "$f")"; done
done
limit=$(( $(left) - 5 )); [ "$limit" -gt 60 ] && {
  timeout "$limit" torchrun --nproc-per-node 1 recipes/moe_gpt.py --preset dsv3-like --permute-in-experts \
    --cuda-graph-impl full_iteration --step-refreshed-weights --modes unpadded bf16 --steps 100 --out /tmp/pd \
    > /tmp/pd.log 2>&1; stamp "preset dsv3-like rc=$?"
  grep -iE "graphed|speedup|rror" /tmp/pd.log | grep -v Warning | tail -12 | cut -c1-300
  for f in /tmp/pd/*.json /tmp/pd/*.png; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tail -c 2500 /tmp/pd.log > "$OUT/dsv3-like.log.tail"; }
