#!/usr/bin/env bash
# Lab: one device call that verifies a tree and its Apex environment: the extension built, Apex built beside it in
# the background (.apex/: Apex's source tarball and its build script, which leaves /tmp/apex/env.sh), the GPU suite without the recipe runs while Apex
# builds, then the Apex recipe tests (tests/test_apex_gpu.py and the -apex resume variants) with what the deadline
# leaves. Carry .whl and .apex. Logs under $OUT.
#   DEADLINE=580 bash lab/device_suite_apex.sh   (carry .whl and .apex)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s); DEADLINE=${DEADLINE:-580}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
echo "built ($(( $(date +%s) - t0 )) s)"
(MAX_JOBS=12 bash .apex/build_apex.sh > "$OUT/apex_build.log" 2>&1; echo "apex build rc=$? ($(( $(date +%s) - t0 )) s)") &
timeout $(( $(left) - ${APEX_TESTS_S:-170} )) python3 -m pytest -q -rfE -m "not recipe_run" tests -p no:cacheprovider \
  --durations=15 > "$OUT/suite.log" 2>&1
echo "suite rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "passed|failed" "$OUT/suite.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -20
wait
[ -f /tmp/apex/env.sh ] || { tail -20 "$OUT/apex_build.log"; exit 1; }
source /tmp/apex/env.sh
timeout $(( $(left) - 5 )) python3 -m pytest -v -p no:cacheprovider tests/test_apex_gpu.py \
  "tests/test_mcore_gpu.py::test_recipe_resumes_bit_exact_after_a_kill[plain-apex]" \
  "tests/test_mcore_gpu.py::test_recipe_resumes_bit_exact_after_a_kill[distributed-apex]" > "$OUT/apex_tests.log" 2>&1
echo "apex tests rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/apex_tests.log" | tail -6
