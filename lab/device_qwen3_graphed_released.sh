#!/usr/bin/env bash
# Lab (one call, <= 8 files back): qwen3-30b from Megatron's full-iteration CUDA graph, unpadded and bf16 graphed plus
# the eager twin (issue 53), at 3 layers (the local spec's unfused attention at sequence 4096 and the graph's pool ran
# out of memory at 5 and 4 on an H100); then the one-pass layer grid with the FP8 weights written from the FP32 masters
# (--release-bf16-weights: the optimizer's write in every twin's step; issues 52 and 54); then qwen3-30b (4 layers)
# with the BF16 expert weights released, unpadded vs bf16 (issue 54's model peak; its summary records the routing
# of the timed steps), while time is left. GRAPHED=0 skips the graphed run (measured at 1b8a12b).
DEADLINE=${DEADLINE:-540}
source lab/device_call.sh
recipe() {  # $1: a name, $2: its limit, then the recipe's options
  local name=$1 limit=$2; shift 2; [ "$(left)" -lt "$limit" ] && limit=$(( $(left) - 5 ))
  [ "$limit" -lt 60 ] && { echo "no time for $name"; return; }
  timeout "$limit" torchrun --nproc-per-node 1 recipes/moe_gpt.py "$@" --out "/tmp/r$name" > "/tmp/r$name.log" 2>&1
  stamp "recipe $name rc=$?"
  grep -E "^\[|speedup|peak_ratio|rror" "/tmp/r$name.log" | grep -v Warning | tail -14 | cut -c1-300
  for f in /tmp/r$name/*.json /tmp/r$name/*.png; do [ -f "$f" ] && cp "$f" "$OUT/$name-$(basename "$f")"; done
  grep -vE "^\s*$" "/tmp/r$name.log" | tail -c 3000 > "$OUT/$name.log.tail"
}
# the deferral's combine by 128-column blocks (b931013) has not run on a GPU: its tests first (TESTS=0 skips them)
[ "${TESTS:-1}" = 1 ] && { timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
  tests/test_wgrad_deferral.py tests/test_mlp_gpu.py -k "defer" > "$OUT/tests.log" 2>&1; stamp "tests rc=$?"
  tail -2 "$OUT/tests.log"; }
[ "${GRAPHED:-1}" = 1 ] && recipe graphed 240 --preset qwen3-30b --layers 3 --permute-in-experts --cuda-graph-impl full_iteration \
  --step-refreshed-weights --modes unpadded bf16 --steps 60
[ "$(left)" -gt 380 ] && { timeout $(( $(left) - ${RESERVE:-230} )) python3 benchmarks/bench_mlp_layer.py --no-graphs \
  --release-bf16-weights --out /tmp/grid > /tmp/grid.log 2>&1; stamp "grid rc=$?"; tail -4 /tmp/grid.log | cut -c1-300
  cp /tmp/grid.log "$OUT/grid.log"; for f in /tmp/grid/*.json; do [ -f "$f" ] && cp "$f" "$OUT/grid-$(basename "$f")"; done; }
recipe released 220 --preset qwen3-30b --layers 4 --permute-in-experts --release-bf16-expert-weights --modes unpadded bf16 \
  --steps 40
