#!/usr/bin/env bash
# Lab: one device call for the K-grouped work: DeepGEMM built, the kernel variants timed against it
# (lab/ab_vs_deepgemm.sh, ncu of the first variant and DeepGEMM), then the benchmark grid and the kernel's GPU tests
# on the first variant's build (the committed default). Logs under $OUT.
#   MEGATRON_TMA_COMMIT=<sha> VARIANTS="base:|..." bash lab/device_ab_then_bench.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/res"
bash .dg/build_deepgemm.sh > "$OUT/dg_build.log" 2>&1; echo "deepgemm build rc=$?"
source /tmp/dg/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
NCU=0 timeout ${AB_TIMEOUT:-300} bash lab/ab_vs_deepgemm.sh 2>&1 | tail -40
base=${VARIANTS%%:*}
cd /tmp/ab/$base || exit 1
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_k_grouped.py --out "$OUT/res" > "$OUT/res/bench_k_grouped.log" 2>&1
echo "bench k_grouped rc=$? in $(( $(date +%s) - t0 )) s"; tail -40 "$OUT/res/bench_k_grouped.log"
timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -x tests/test_deepgemm_gpu.py tests/test_k_grouped_gpu.py 2>&1 | tail -5
cd - > /dev/null
SKIP_BUILD=1 NCU=1 ROUNDS=0 OUT=$OUT timeout ${NCU_TIMEOUT:-120} bash lab/ab_vs_deepgemm.sh 2>&1 | tail -3
grep -E "^  [a-z_]|Duration|Elapsed Cycles|Tensor|SM Busy|Memory Throughput|L1/TEX Hit|gmma|wavefronts|bank_conflicts|inst_executed.sum|lts__t_bytes|dram__bytes|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|sm90_fp8|k_grouped_fp8_gemm_kernel" "$OUT/ab/ncu.txt" | head -70
