#!/usr/bin/env bash
# Lab (one call, <= 8 files back): qwen3-30b (4 layers: 5 with a full-iteration graph's pool and torch's foreach Adam
# ran out of memory) from Megatron's full-iteration CUDA graph, unpadded and bf16 graphed plus the eager twin (issue
# 53; 4 layers ran out too, the local spec's unfused attention at sequence 4096); then qwen3-30b (4 layers) with the BF16 expert weights released (issue 54's model peak), unpadded vs bf16; then the
# layer grid with the optimizer's write in every twin while time is left (issue 52/54).
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
recipe graphed 300 --preset qwen3-30b --layers 3 --permute-in-experts --cuda-graph-impl full_iteration \
  --step-refreshed-weights --modes unpadded bf16 --steps 60
recipe released 220 --preset qwen3-30b --layers 4 --permute-in-experts --release-bf16-expert-weights --modes unpadded bf16 \
  --steps 40
[ "${GRID:-0}" = 1 ] && [ "$(left)" -gt 150 ] && { timeout $(( $(left) - 10 )) python3 benchmarks/bench_mlp_layer.py --no-graphs \
  --release-bf16-weights --out /tmp/grid > /tmp/grid.log 2>&1; stamp "grid rc=$?"; tail -4 /tmp/grid.log | cut -c1-300
  for f in /tmp/grid/*.json; do [ -f "$f" ] && cp "$f" "$OUT/grid-$(basename "$f")"; done; }
