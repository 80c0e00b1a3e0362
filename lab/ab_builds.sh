#!/usr/bin/env bash
# A/B of two source trees of the extension on one GPU machine, in one call: the working tree ("head") against
# another tree ("base", e.g. `git archive <commit> csrc megatron_tma scripts setup.py pyproject.toml | tar -x -C
# .ab/base`, carried to the machine as an ignored path). Both are built (in parallel, each as setup.py builds it,
# FFMA hint rewrite included); head's M-grouped outputs on every tile shape are compared bit for bit with base's
# (lab/gemm_bits.py); then `ours` on the five reference rows of docs/design.md §5 (lab/time_m_grouped_rows.py) is timed for
# both builds and each tile shape in ARGSETS, alternating processes in rotated order (the same build moves by a
# few % between processes), and lab/ab_summary.py prints each variant's geomean against base's.
#   usage (GPU machine, repo root, wheels on PYTHONPATH):
#     ROUNDS=3 ARGSETS="--block-m=128;--block-m=192" bash lab/ab_builds.sh .ab/base
# Leaves head's build in place (megatron_tma/_C*.so).
set -uo pipefail
BASE=${1:?usage: ab_builds.sh BASE_TREE}
OUT=${OUT:-/tmp/out}
D="$OUT/ab"
mkdir -p "$D" /tmp/ab_so
IFS=';' read -r -a argsets <<< "${ARGSETS:---block-m=128}"
build() {  # dir name
  local t0=$(date +%s)
  (cd "$1" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=8 python3 setup.py build_ext --inplace > "$D/build_$2.log" 2>&1) \
    || { echo "build $2 failed"; tail -30 "$D/build_$2.log"; return 1; }
  cp "$1"/megatron_tma/_C*.so "/tmp/ab_so/$2.so"
  echo "build $2: $(( $(date +%s) - t0 )) s; $(grep -h 'control words rewritten' "$D/build_$2.log" | head -1)"
}
build "$BASE" base & pb=$!
build . head & ph=$!
wait $pb || exit 1
wait $ph || exit 1
so=$(ls megatron_tma/_C*.so)
cp /tmp/ab_so/base.so "$so"
python3 lab/gemm_bits.py save "$D/bits.pt" | sed "s/^/bits base: /"
cp /tmp/ab_so/head.so "$so"
python3 lab/gemm_bits.py compare "$D/bits.pt" | sed "s/^/bits head: /"
variants=()
for a in "${argsets[@]}"; do variants+=("base $a" "head $a"); done
source lab/ab_rounds.sh
time_rotated /tmp/ab_so "$so" "${ROUNDS:-3}" "${variants[@]}"
cp /tmp/ab_so/head.so "$so"
for a in "${argsets[@]}"; do
  grep -F "\"base $a\"" "$D/times.jsonl" > "$D/pair.jsonl"; grep -F "\"head $a\"" "$D/times.jsonl" >> "$D/pair.jsonl"
  python3 lab/ab_summary.py "$D/pair.jsonl" "base $a"
done
