#!/usr/bin/env bash
# Lab: one device call (~7-9 minutes) that decides the K-grouped tile branches, run with the branch
# `kgrouped-192x128` checked out (it holds the uniform-descriptor fix and the 192 x 128 tile as block_m=192).
# Ran at 92cd967 (lab/results/kgrouped_ab_tiles-20261203.txt; merged as 4afbb18, where the default became the
# tile of scheduler/k_grouped_tile_choice.h, so on main `head` and `m192` run the same kernel on these shapes):
#   1. lab/ab_kgrouped_trees.sh: main (.ab/base), the branch's default tile (head), its 192-row tile (m192) and
#      the 152-wide tile with the fix (.ab/wide, branch wgrad-wide152-uniform), each against DeepGEMM, 2 rounds;
#   2. the K-grouped GPU tests on the branch's build (both tiles' bits, the suite, DeepGEMM's bits);
#   3. bench_k_grouped.py's grid on the branch's build (ours_m192 beside the default, DeepGEMM in the same process).
# Before the call, here:
#   rm -rf .ab && mkdir -p .ab/base .ab/wide
#   git archive main csrc megatron_tma scripts setup.py pyproject.toml _build_backend.py MANIFEST.in | tar -x -C .ab/base
#   git archive wgrad-wide152-uniform csrc megatron_tma scripts setup.py pyproject.toml _build_backend.py MANIFEST.in \
#     | tar -x -C .ab/wide
# then: MEGATRON_TMA_COMMIT=<branch sha> bash lab/device_kgrouped_tiles.sh   (carry .dg .whl .ab)
# All three may not fit one 600 s call: PHASES="ab" first, then PHASES="tests bench" on the warm machine (it keeps
# the branch's build in place; lab/device_setup.sh rebuilds what is missing or stale). Logs, JSON and PNG come
# back packed in $OUT/res.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/res"
t0=$(date +%s)
PHASES=${PHASES:-ab tests bench}
if [[ " $PHASES " == *" ab "* ]]; then
  OUT=$OUT/res ROUNDS=${ROUNDS:-2} timeout ${AB_TIMEOUT:-450} bash lab/ab_kgrouped_trees.sh base=.ab/base head=. \
    m192=.:--block-m=192 wide=.ab/wide@MEGATRON_TMA_KGROUPED_WIDE=1 2>&1 | tee "$OUT/res/ab.log" \
    | grep -E "^==|x[0-9]|rc=|built"
fi
if [[ " $PHASES " == *" tests "* || " $PHASES " == *" bench "* ]]; then
  LOGS=$OUT/res source lab/device_setup.sh || exit 1  # the branch's build (up to date after the ab phase)
fi
if [[ " $PHASES " == *" tests "* ]]; then
  echo "== tests ($(( $(date +%s) - t0 )) s)"
  timeout 150 python3 -m pytest -q -x tests/test_k_grouped_tiles_gpu.py tests/test_k_grouped_gpu.py \
    tests/test_deepgemm_gpu.py > "$OUT/res/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/res/tests.log"
fi
if [[ " $PHASES " == *" bench "* ]]; then
  echo "== bench_k_grouped ($(( $(date +%s) - t0 )) s)"
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_k_grouped.py --out "$OUT/res" > "$OUT/res/bench_k_grouped.log" 2>&1
  echo "bench rc=$?"; grep -E "summary|wrote" "$OUT/res/bench_k_grouped.log" | tail -2
fi
tar czf "$OUT/res.tgz" -C "$OUT" res && rm -rf "$OUT/res"
echo "total $(( $(date +%s) - t0 )) s"
