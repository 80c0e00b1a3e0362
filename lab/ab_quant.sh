#!/usr/bin/env bash
# A/B of the grouped quantizers between source trees, in one GPU-machine call: each tree is built as setup.py
# builds it (in parallel), every output of every shape of lab/time_quant_rows.py is compared bit for bit with the
# first tree's, and the shapes are timed in alternating processes, rotated over ROUNDS rounds (the same build moves
# by a few % between processes).
#   usage (GPU machine, repo root, wheels on PYTHONPATH):
#     ROUNDS=3 bash lab/ab_quant.sh base=.ab/base head=. head4=.ab/head4
# A tree given as NAME=DIR[:NVCC_EXTRA] is built with MEGATRON_TMA_NVCC_EXTRA=NVCC_EXTRA (e.g.
# "head4=.ab/head4:-DMEGATRON_TMA_QUANT_GROUPED_CTAS=4"). The first tree is the baseline. Writes $OUT/ab_quant/:
# build logs, times.jsonl (one line per process) and summary.txt. Leaves the last timed
# variant's build in megatron_tma/ (the builds stay in /tmp/abq_so/NAME.so).
set -uo pipefail
OUT=${OUT:-/tmp/out}
D="$OUT/ab_quant"
mkdir -p "$D" /tmp/abq_so
names=(); dirs=(); extras=()
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; dir=${rest%%:*}; extra=""
  [[ "$rest" == *:* ]] && extra=${rest#*:}
  names+=("$name"); dirs+=("$dir"); extras+=("$extra")
done
jobs=$(( 15 / ${#names[@]} )); [ "$jobs" -ge 1 ] || jobs=1
build() {  # index
  local i=$1 t0; t0=$(date +%s)
  (cd "${dirs[$i]}" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$jobs MEGATRON_TMA_NVCC_EXTRA="${extras[$i]}" \
    python3 setup.py build_ext --inplace > "$D/build_${names[$i]}.log" 2>&1) \
    || { echo "build ${names[$i]} failed"; tail -30 "$D/build_${names[$i]}.log"; return 1; }
  cp "${dirs[$i]}"/megatron_tma/_C*.so "/tmp/abq_so/${names[$i]}.so"
  echo "build ${names[$i]}: $(( $(date +%s) - t0 )) s"
}
pids=()
for i in "${!names[@]}"; do build "$i" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
# The extension is imported from this tree's megatron_tma (PYTHONPATH has the repo root): each variant's build is
# copied over it in turn.
so=megatron_tma/$(basename "$(ls "${dirs[0]}"/megatron_tma/_C*.so | head -1)")
if [ "${BITS:-1}" = 1 ]; then  # BITS=0 skips the comparison (when the GPU tests check the bits instead)
  cp "/tmp/abq_so/${names[0]}.so" "$so"
  python3 lab/time_quant_rows.py --save /tmp/abq_bits.pt | sed "s/^/bits ${names[0]}: /"
  for n in "${names[@]:1}"; do
    cp "/tmp/abq_so/$n.so" "$so"
    python3 lab/time_quant_rows.py --compare /tmp/abq_bits.pt | sed "s/^/bits $n: /"
  done
fi
n_var=${#names[@]}
for r in $(seq 0 $(( ${ROUNDS:-3} - 1 ))); do
  for j in $(seq 0 $(( n_var - 1 ))); do
    n=${names[$(( (j + r) % n_var ))]}
    cp "/tmp/abq_so/$n.so" "$so"
    echo "{\"variant\": \"$n\", \"round\": $r, \"tbps\": $(python3 lab/time_quant_rows.py 2>>"$D/err.log" || echo null)}" \
      >> "$D/times.jsonl"
  done
  echo "round $r done"
done
python3 lab/ab_summary.py "$D/times.jsonl" "${names[0]}" | tee "$D/summary.txt"
