#!/usr/bin/env bash
# One device call without TE (TE's site is not on PYTHONPATH): the wheels, the kernels, the quantizer benchmark
# (JSON/PNG into $OUT), then every GPU test outside the recipe runs. Logs into $OUT.
# Optional: STAGE=.tec1b (a TE chunk carried along: staged and checked first, scripts/te_device_steps.md).
set -uo pipefail
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if [ -n "${STAGE:-}" ]; then
  mkdir -p .te_stage && cp $STAGE/* .te_stage/ && (cd .te_stage && sha256sum -c --quiet SHA256SUMS.tec1) && el "staged $STAGE"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD MEGATRON_TMA_COMMIT=${COMMIT:-unknown}
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
el built; python3 -m megatron_tma --check 2>&1 | tail -3
timeout ${BENCH_S:-150} python3 benchmarks/bench_quant.py --out $OUT > $OUT/bench_quant.log 2>&1; el "bench_quant rc=$?"
tail -20 $OUT/bench_quant.log
timeout $(( ${TOTAL_S:-580} - ($(date +%s) - T0) )) python3 -m pytest -q -rfEs -p no:cacheprovider --timeout=300 \
  -m "not recipe_run" tests > $OUT/no_te.log 2>&1; el "pytest rc=$?"
tail -15 $OUT/no_te.log
