#!/usr/bin/env bash
# The recipe's expert-parallel scaling runs on one machine of NPROC GPUs (4 or 8): each a recipes/moe_gpt.py run that
# checks unpadded == padded16 bit for bit and draws the loss plot; results (JSON + PNG, with tokens per second per
# GPU per mode) under OUT_DIR/<run>/, logs in OUT_DIR/<run>.log. Routing is DeepSeek-V3-like: 64 experts, top-8,
# Megatron's all-to-all dispatcher.
#   usage: bash scripts/recipe_scaling.sh NPROC OUT_DIR [extra recipe args ...]
#   DRY_RUN=1 prints the runs' argument lists (one per line, run name first) instead of running them.
# Runs, for NPROC = N:
#   ep<N>            EP = N, modes unpadded padded16 bf16 megatron (step time per mode, the loss curves)
#   ep<N>-distopt    the same with --distributed-optimizer --overlap-grad-reduce --overlap-param-gather
#   ep<N/2>-pp2      EP = N/2 x 2 pipeline stages (4 micro-batches)
#   ep<N/2>-etp2     EP = N/2 x expert tensor parallelism 2
# Exit status: 1 if any run failed (a bit-exactness check included). RECIPE_RUN_TIMEOUT (s, default 1800) per run.
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
nproc=$1 out=$2
shift 2
cd "$(dirname "$0")/.."
half=$((nproc / 2))
common=(--layers 4 --hidden 1024 --heads 8 --experts 64 --topk 8 --expert-ffn 512 --seq-len 512
        --micro-batch-size 8 --steps 200 --log-every 20)
runs=(
  "ep$nproc --ep $nproc --modes unpadded padded16 bf16 megatron"
  "ep$nproc-distopt --ep $nproc --modes unpadded padded16 --distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
  "ep$half-pp2 --ep $half --pp 2 --micro-batches 4 --modes unpadded padded16 megatron"
  "ep$half-etp2 --ep $half --etp 2 --modes unpadded padded16 megatron"
)
failed=0
for run in "${runs[@]}"; do
  read -ra words <<< "$run"
  name=${words[0]}
  args=("${common[@]}" "${words[@]:1}" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "$name ${args[*]}"
    continue
  fi
  mkdir -p "$out/$name"
  t0=$(date +%s)
  timeout "${RECIPE_RUN_TIMEOUT:-1800}" python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    recipes/moe_gpt.py "${args[@]}" --out "$out/$name" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "bit for bit|failures|Error" "$out/$name.log" | tail -4
  [ $rc -eq 0 ] || failed=1
done
exit $failed
