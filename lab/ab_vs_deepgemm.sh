#!/usr/bin/env bash
# Lab: compile-time variants of the K-grouped kernel, each timed against DeepGEMM in the same process
# (lab/kgrouped_vs_deepgemm.py), in rotated rounds; optionally ncu of the first variant and DeepGEMM on one shape.
# Needs DeepGEMM importable (its build's env.sh sourced) and the carried wheels on PYTHONPATH.
#   VARIANTS="base:|one128:-DMEGATRON_TMA_KG_ONE_FRAGMENT=1" ROUNDS=2 SHAPES=G:M:N:K,... NCU=1 bash lab/ab_vs_deepgemm.sh
#   (SKIP_BUILD=1 ROUNDS=0 NCU=1: only ncu, on the variants an earlier call built)
set -uo pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/ab; mkdir -p "$D"
IFS='|' read -r -a variants <<< "${VARIANTS:-base:}"
n=${#variants[@]}; jobs=$(( 16 / n )); [ $jobs -lt 2 ] && jobs=2
names=()
t0=$(date +%s)
for v in "${variants[@]}"; do
  name=${v%%:*}; flags=${v#*:}; names+=("$name")
  [ "${SKIP_BUILD:-0}" = 1 ] && continue  # built by an earlier call in this session
  dst=/tmp/ab/$name; rm -rf "$dst"; mkdir -p "$dst"
  cp -r csrc megatron_tma scripts benchmarks lab tests setup.py pyproject.toml _build_backend.py "$dst"/ 2>/dev/null
  ( cd "$dst" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=$jobs MEGATRON_TMA_NVCC_EXTRA="$flags" \
      python3 setup.py build_ext --inplace > "$D/build_$name.log" 2>&1 && echo "built $name" \
      || { echo "build $name FAILED"; tail -20 "$D/build_$name.log"; } ) &
done
wait
echo "builds took $(( $(date +%s) - t0 )) s"
SHAPES=${SHAPES:-8:16384:4096:4096,16:32768:7168:4096,8:65536:6144:5120,32:16384:3072:8192,32:8192:4096:7168}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${names[$(( (i + r) % n ))]}
    echo "== round $r variant $name"
    ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:${PYTHONPATH:-} timeout 240 python3 lab/kgrouped_vs_deepgemm.py \
        --iters "${ITERS:-10}" --shapes "$SHAPES" --dist "${DIST:-paper}" --json "$D/${name}_r$r.json" ) 2>&1 | tail -8
  done
done
ncu_run() {
  name=${names[0]}
  ( cd /tmp/ab/$name && PYTHONPATH=/tmp/ab/$name:${PYTHONPATH:-} timeout 240 ncu --clock-control none \
      --kernel-name regex:"k_grouped_fp8_gemm_kernel|sm90_fp8_gemm_1d1d" --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,lts__t_bytes.sum,dram__bytes.sum \
      python3 lab/kgrouped_vs_deepgemm.py --iters 1 --shapes "${NCU_SHAPE:-8:16384:4096:4096}" ) > "$D/ncu.txt" 2>&1
  echo "ncu rc=$? ($D/ncu.txt)"
}
[ "${NCU:-0}" = 1 ] && ncu_run
