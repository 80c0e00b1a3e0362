#!/usr/bin/env bash
# Lab: an M-grouped kernel change against its base in one device call (~6-9 minutes): both trees built in place
# beside DeepGEMM; the bits of every tile compared (lab/gemm_bits.py, base saves, head compares); the M-grouped GPU
# tests on the head; bench_m_grouped.py --quick (the five reference rows, DeepGEMM in the same process) per tree in
# ROUNDS rotated rounds, each tree running its own copy of the benchmark; then, with FULL=1, the head's full grid.
# Optional extras in the same call: NCU_KG=1 (ncu of our K-grouped kernel and DeepGEMM's on G=8 M=16384 N=K=4096),
# PROFILE="model:G:M ..." (lab/profile_mlp_layer.py, one process per config). Everything lands in $OUT/res.tgz.
#   git archive <base-rev> csrc megatron_tma scripts setup.py pyproject.toml _build_backend.py MANIFEST.in lab \
#     benchmarks/*.py | tar -x -C .ab/base        (then, on the GPU machine, carry .ab .dg .whl)
#   ROUNDS=2 FULL=1 NCU_KG=1 PROFILE="qwen3_30b_a3b:128:32768" bash lab/device_mgrouped_ab.sh
# HEAD_NVCC_EXTRA: extra nvcc flags for the head's build only, for a build-time variant of the same tree; e.g. the
# general M-grouped loop alone: HEAD_NVCC_EXTRA=-DMEGATRON_TMA_MG_FIXED_STAGE=0 (base: `git archive HEAD ...` as above).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
BASE=${BASE:-.ab/base}
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site
(bash .dg/build_deepgemm.sh > "$R/dg_build.log" 2>&1; echo "deepgemm build rc=$?") &
(cd "$BASE" && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=7 python3 setup.py build_ext --inplace > "$R/build_base.log" 2>&1
 echo "base build rc=$?") &
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=8 MEGATRON_TMA_NVCC_EXTRA="${HEAD_NVCC_EXTRA:-}" \
  python3 setup.py build_ext --inplace > "$R/build_head.log" 2>&1
echo "head build rc=$?"; wait; echo "built ($(since))"
ls megatron_tma/_C*.so "$BASE"/megatron_tma/_C*.so > /dev/null || { tail -20 "$R"/build_*.log; exit 1; }
source /tmp/dg/env.sh  # DeepGEMM's install joins PYTHONPATH

python3 "$BASE/lab/gemm_bits.py" save "$R/bits_base.pt" > "$R/bits.log" 2>&1
python3 lab/gemm_bits.py compare "$R/bits_base.pt" >> "$R/bits.log" 2>&1; echo "bits compare rc=$? ($(since))"
tail -3 "$R/bits.log"
timeout 300 python3 -m pytest -q -x tests/test_m_grouped_gpu.py > "$R/tests_m_grouped.log" 2>&1
echo "M-grouped GPU tests rc=$? ($(since))"; tail -2 "$R/tests_m_grouped.log"

trees=(base head); declare -A dir=([base]=$BASE [head]=.)
for r in $(seq 1 "${ROUNDS:-2}"); do
  order=("${trees[@]:$(( (r - 1) % 2 ))}" "${trees[@]:0:$(( (r - 1) % 2 ))}")
  for t in "${order[@]}"; do
    mkdir -p "$R/quick_${t}_r$r"
    (cd "${dir[$t]}" && timeout 120 python3 benchmarks/bench_m_grouped.py --quick --out "$R/quick_${t}_r$r") \
      > "$R/quick_${t}_r$r.log" 2>&1
    echo "quick $t round $r rc=$? ($(since))"; grep -iE "geomean|min_vs" "$R/quick_${t}_r$r.log" | tail -3
  done
done
if [ "${FULL:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/bench_m_grouped.py --out "$R" > "$R/bench_m_grouped.log" 2>&1
  echo "full grid rc=$? ($(since))"; tail -4 "$R/bench_m_grouped.log"
fi
if [ "${NCU_KG:-0}" = 1 ]; then
  timeout 200 ncu --clock-control none --kernel-name regex:"k_grouped_fp8_gemm_kernel|sm90_fp8_gemm_1d1d" \
    --launch-count 4 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,lts__t_bytes.sum,dram__bytes.sum,gpu__time_duration.sum \
    python3 lab/kgrouped_vs_deepgemm.py --iters 1 --shapes 8:16384:4096:4096 > "$R/ncu_kgrouped.txt" 2>&1
  echo "ncu rc=$? ($(since))"
fi
for c in ${PROFILE:-}; do
  timeout 120 python3 lab/profile_mlp_layer.py --config "$c" --json "$R/profile_${c//:/_}.json" \
    > "$R/profile_${c//:/_}.log" 2>&1
  echo "profile $c rc=$? ($(since))"
done
tar czf "$OUT/res.tgz" -C "$OUT" res && rm -rf "$R"
echo "total $(since)"
