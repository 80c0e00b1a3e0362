#!/usr/bin/env bash
# One device call: install carried wheels, build the extension, run the test suite and the named benchmarks.
# Everything lands under $OUT (logs + one tarball of benchmark results), the table prints last.
#   usage (on the GPU machine, repo root): bash scripts/gpu_session.sh [pytest-args] -- [bench ...]
#   bench: m_grouped, k_grouped, quant, mlp_layer; each ":word" appended becomes "--word" (e.g. m_grouped:quick,
#          mlp_layer:quick:weight-layout=per_expert)
#   SANITIZE=1 also runs the smoke check under compute-sanitizer memcheck (about a minute)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 MEGATRON_TMA_PTXAS_V=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
grep -E "registers|spill|error|C751[4-8]" "$OUT/build.log" | grep -v "^ptxas info    : Compile time" | head -40
[ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit $rc; }
python3 -m megatron_tma | tail -n +3  # what this build runs (the extension, each GPU, why not)
timeout 120 python3 scripts/smoke.py 2>&1 | tail -20
smoke=${PIPESTATUS[0]}
[ "$smoke" -eq 124 ] && { echo "smoke hung: stopping"; exit 1; }
if [ "$smoke" -ne 0 ]; then  # locate the fault (file:line via -lineinfo), then carry on for more evidence
  timeout 180 compute-sanitizer --tool memcheck --show-backtrace device python3 scripts/smoke.py 2>&1 | grep -v "^=========     Host Frame" | head -40
fi
if [ "${SANITIZE:-0}" = 1 ]; then  # issues 3/4: memcheck must be clean on a small case
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/smoke.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? (0 = clean)"; tail -3 "$OUT/memcheck.log"
fi
pytest_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pytest_args+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfEs --timeout=180 "${pytest_args[@]:-tests}" > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests.log" | tail -30
mkdir -p "$OUT/res"
if [ $# -gt 0 ] && [ -z "${MEGATRON_TMA_COMMIT:-}" ] && [ ! -d .git ]; then
  echo "WARNING: MEGATRON_TMA_COMMIT unset and no .git: results will say commit 'unknown' (use scripts/device_command.sh)"
fi
i=0
for b in "$@"; do
  i=$((i + 1))
  name=${b%%:*}; flag=""
  if [ "$b" != "$name" ]; then IFS=: read -ra words <<< "${b#*:}"; for w in "${words[@]}"; do flag="$flag --$w"; done; fi
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-400} python3 "benchmarks/bench_${name}.py" $flag --out "$OUT/res" > "$OUT/res/bench_${i}_${name}.log" 2>&1
  echo "bench $name$flag rc=$? in $(( $(date +%s) - t0 )) s"; tail -45 "$OUT/res/bench_${i}_${name}.log"
done
tar czf "$OUT/results.tar.gz" -C "$OUT" res && rm -rf "$OUT/res"
