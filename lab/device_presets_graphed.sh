#!/usr/bin/env bash
# Lab (one call, <= 8 files back): the compile test and the transpose kernel in backward, then the presets (issue 53's
# targets) from Megatron's full-iteration CUDA graph with step-refreshed FP8 weights, unpadded and bf16 graphed plus
# the recipe's eager twin of unpadded: dsv3-like, then qwen3-30b while time is left.
DEADLINE=${DEADLINE:-540}
source lab/device_call.sh
[ "${TESTS:-1}" = 1 ] && timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE "tests/test_autograd.py::test_torch_compile_forward" \
  tests/test_transposed_weight.py tests/test_mlp_gpu.py -k "compile or transpos" > "$OUT/tests.log" 2>&1
stamp "tests rc=$?"; tail -3 "$OUT/tests.log"
preset() {  # $1: the preset, $2: its time limit
  local limit=$2; [ "$(left)" -lt "$limit" ] && limit=$(( $(left) - 5 ))
  [ "$limit" -lt 60 ] && { echo "no time for $1"; return; }
  timeout "$limit" torchrun --nproc-per-node 1 recipes/moe_gpt.py --preset "$1" --permute-in-experts \
    --cuda-graph-impl full_iteration --step-refreshed-weights --modes unpadded bf16 --steps "$3" --out "/tmp/p$1" \
    > "/tmp/p$1.log" 2>&1; stamp "preset $1 rc=$?"
  grep -iE "graphed|speedup|error|Error" "/tmp/p$1.log" | grep -v Warning | tail -12 | cut -c1-300
  for f in /tmp/p$1/*.json /tmp/p$1/*.png; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tail -c 3000 "/tmp/p$1.log" > "$OUT/$1.log.tail"
}
preset dsv3-like 200 100
# then the W^T-in-backward layer on the transpose kernel (was torch's strided copy)
[ "${TESTS:-1}" = 1 ] && timeout 75 python3 benchmarks/bench_mlp_layer.py --models qwen3_30b_a3b --micro-batches 4 --transpose-in-backward \
  --no-graphs --out /tmp/bt > /tmp/bt.log 2>&1; stamp "bench transpose rc=$?"; grep -E "^ qwen3" /tmp/bt.log | head -8
for f in /tmp/bt/*.json; do [ -f "$f" ] && cp "$f" "$OUT/transpose-$(basename "$f")"; done
preset qwen3-30b 300 60
