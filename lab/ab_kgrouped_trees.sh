#!/usr/bin/env bash
# Lab: the K-grouped kernels of several source trees against DeepGEMM 2.6.1, in one device call (~3-4 minutes).
# Each tree (the working tree ".", or an ignored copy carried to the machine, e.g. `git archive <rev> csrc
# megatron_tma scripts setup.py pyproject.toml _build_backend.py MANIFEST.in | tar -x -C .ab/<name>`) is built in
# place in parallel with DeepGEMM; then this tree's lab/kgrouped_vs_deepgemm.py (the issue's five shapes, ours and
# DeepGEMM in one process, bits compared) runs once per name, importing that name's tree's own package and build,
# ROUNDS times in rotated order, each with its own environment (e.g. a kernel switch, after @) and arguments to the
# script (after :). The ratio to DeepGEMM is the number to compare.
#   usage (GPU machine, repo root; carry .dg .whl .ab):
#     bash lab/ab_kgrouped_trees.sh base=.ab/base head=. [m192=.:--block-m=192] [wide=.ab/wide@VAR=1 ...]
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: ab_kgrouped_trees.sh NAME=TREE[@VAR=VALUE][:ARGS] ..." >&2; exit 2; }
OUT=${OUT:-/tmp/out}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
names=(); declare -A tree env args
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; args[$name]=""
  [[ $rest == *:* ]] && { args[$name]=${rest#*:}; rest=${rest%%:*}; }
  names+=("$name"); tree[$name]=${rest%%@*}; env[$name]=""
  [[ $rest == *@* ]] && env[$name]=${rest#*@}
done
declare -A seen; trees=()  # each tree built once, whatever the number of names (environments) it runs under
for n in "${names[@]}"; do [ -n "${seen[${tree[$n]}]:-}" ] || { seen[${tree[$n]}]=1; trees+=("${tree[$n]}"); }; done
jobs=$(( 16 / (${#trees[@]} + 1) )); [ $jobs -ge 2 ] || jobs=2
(bash .dg/build_deepgemm.sh > "$OUT/dg_build.log" 2>&1; echo "deepgemm build rc=$?") &
for t in "${trees[@]}"; do
  (cd "$t" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$jobs python3 setup.py build_ext --inplace \
     > "$OUT/build_$(echo "$t" | tr '/.' '__').log" 2>&1; echo "build $t rc=$?") &
done
wait; echo "built in $(( $(date +%s) - t0 )) s"
for t in "${trees[@]}"; do ls "$t"/megatron_tma/_C*.so > /dev/null || exit 1; done
source /tmp/dg/env.sh
base_path=$PYTHONPATH  # .site, this tree and DeepGEMM's install, from env.sh
for r in $(seq 1 "${ROUNDS:-2}"); do
  order=("${names[@]:$(( (r - 1) % ${#names[@]} ))}" "${names[@]:0:$(( (r - 1) % ${#names[@]} ))}")
  for n in "${order[@]}"; do
    # The tree's own package and build (its Python may differ from this one's); the timing script is this tree's.
    pkg=$(cd "${tree[$n]}" && pwd)
    echo "== round $r: $n ${env[$n]} ${args[$n]} ($(( $(date +%s) - t0 )) s)"
    env ${env[$n]} PYTHONPATH="$pkg:$base_path" timeout ${RUN_TIMEOUT:-60} python3 lab/kgrouped_vs_deepgemm.py \
      --iters ${ITERS:-20} ${args[$n]} 2>&1 | grep -v -i warn | tail -6
  done
done
