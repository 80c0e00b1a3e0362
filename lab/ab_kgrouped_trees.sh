#!/usr/bin/env bash
# Lab: the K-grouped kernel of two source trees against DeepGEMM 2.6.1, in one device call (~3 minutes): the
# working tree ("head") and BASE (e.g. `git archive <commit> csrc megatron_tma scripts setup.py pyproject.toml
# _build_backend.py MANIFEST.in | tar -x -C .ab/base`, carried as an ignored path) built in parallel with DeepGEMM,
# then lab/kgrouped_vs_deepgemm.py (the five shapes, ours and DeepGEMM in one process, bits compared) run
# with each build in the order base, head, head, base: the ratio to DeepGEMM is the number to compare.
#   usage (GPU machine, repo root; carry .dg .whl .ab): bash lab/ab_kgrouped_trees.sh .ab/base
set -uo pipefail
BASE=${1:?usage: ab_kgrouped_trees.sh BASE_TREE}
OUT=${OUT:-/tmp/out}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
build() {  # dir name
  (cd "$1" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=6 python3 setup.py build_ext --inplace > "$OUT/build_$2.log" 2>&1)
  echo "build $2 rc=$?"
}
(bash .dg/build_deepgemm.sh > "$OUT/dg_build.log" 2>&1; echo "deepgemm build rc=$?") &
build "$BASE" base &
build . head &
wait; echo "built in $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/ab_so
so=$(ls megatron_tma/_C*.so) && cp "$so" /tmp/ab_so/head.so && cp "$BASE"/megatron_tma/_C*.so /tmp/ab_so/base.so || exit 1
source /tmp/dg/env.sh
for v in base head head base; do
  cp /tmp/ab_so/$v.so "$so"
  echo "== $v ($(( $(date +%s) - t0 )) s)"
  timeout ${RUN_TIMEOUT:-60} python3 lab/kgrouped_vs_deepgemm.py --iters ${ITERS:-20} 2>&1 | grep -v -i warn | tail -6
done
cp /tmp/ab_so/head.so "$so"
