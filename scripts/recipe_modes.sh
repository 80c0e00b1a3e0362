#!/usr/bin/env bash
# Run recipes/moe_gpt.py once per experts mode, each mode in its own torchrun (so that each process's peak memory is
# its mode's alone, and a mode that runs out of memory does not take the others with it), then check the modes as one run with
# `moe_gpt.py --compare`, which writes the merged JSON and PNG into OUT_DIR. Exit status: the merge's (1 if a
# bit-exactness or same-init check failed), or 1 if any mode did not leave a result.
#   usage: bash scripts/recipe_modes.sh OUT_DIR NPROC "MODE [MODE ...]" [recipe args ...]
#   e.g.   bash scripts/recipe_modes.sh /tmp/ds 1 "unpadded padded16 padded128 bf16 megatron" \
#              --layers 2 --hidden 7168 --heads 56 --experts 32 --expert-ffn 2048 --topk 4 --seq-len 2048 \
#              --micro-batch-size 4 --steps 20 --log-every 5
# Each mode's log is OUT_DIR/<mode>.log and its own result OUT_DIR/<mode>/moe_gpt-*.json (for a later --compare
# with modes run elsewhere). RECIPE_MODE_TIMEOUT (seconds, default 900) stops a mode that hangs.
set -uo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
out=$1 nproc=$2 modes=$3
shift 3
cd "$(dirname "$0")/.."
mkdir -p "$out"
results=() missing=0
for mode in $modes; do
  t0=$(date +%s)
  timeout "${RECIPE_MODE_TIMEOUT:-900}" python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    recipes/moe_gpt.py --modes "$mode" --out "$out/$mode" "$@" > "$out/$mode.log" 2>&1
  rc=$?
  echo "mode $mode: rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "^\[|Error|error:" "$out/$mode.log" | tail -6
  result=$(ls "$out/$mode"/moe_gpt-*.json 2>/dev/null | tail -1)
  if [ -n "$result" ]; then results+=("$result"); else missing=1; echo "mode $mode: no result"; fi
done
[ ${#results[@]} -gt 0 ] || exit 1
python3 recipes/moe_gpt.py --compare "${results[@]}" --out "$out"
rc=$?
[ $missing -eq 0 ] || rc=1
exit $rc
