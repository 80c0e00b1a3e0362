#!/usr/bin/env bash
# Lab: one device call made of phases, each run only if the call's deadline leaves it its estimated time, so that a
# 30-minute session can be planned as a few full calls that each come back with their logs ($OUT/res.tgz) even when
# a phase overruns. Carry .whl and .dg (DeepGEMM's build script), and .ab when VARIANT_FLAGS is set.
#   PHASES="build suite ab" VARIANT_FLAGS=-DMEGATRON_TMA_MG_CLUSTER=1 bash lab/device_session.sh
# Phases (in the order given):
#   build    wheels into .site; this tree's extension, DeepGEMM, and (VARIANT_FLAGS) a copy of this tree under .ab/var
#            built with those extra nvcc flags, all in parallel (a warm machine rebuilds incrementally)
#   suite    the GPU test suite without the recipe runs (-m "not recipe_run")
#   recipes  the recipe runs, -k "not resumes" (or -k "$RECIPE_K");  resumes: the recipe runs, -k resumes
#   ab       the variant against this tree: bits of every M-grouped tile (lab/gemm_bits.py), the M-grouped GPU tests on
#            the variant, bench_m_grouped.py --quick per tree in ROUNDS alternating rounds (DeepGEMM in each process)
#   grids    the benchmark grids named in BENCHES (name:limit_s ...), JSON + PNG under res/
#   vargrid  the variant's full M-grouped grid
#   ncu_mg   our M-grouped kernel against DeepGEMM's on the rows it loses (MG_SHAPES, G:M:N:K ...): timed side by side
#            with DeepGEMM's layout printed (lab/mgrouped_vs_deepgemm.py, extra arguments MG_ARGS), in each tree of
#            MG_TREES (base, var), then (unless MG_NCU=0) ncu of both on the first shape
# The variant tree: mkdir -p .ab/var && git archive HEAD csrc megatron_tma scripts setup.py pyproject.toml \
#   _build_backend.py MANIFEST.in lab benchmarks tests | tar -x -C .ab/var
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
t0=$(date +%s); DEADLINE=${DEADLINE:-560}
since() { echo "$(( $(date +%s) - t0 )) s"; }
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
pack() { tar czf "$OUT/res.tgz" -C "$OUT" res 2>/dev/null && rm -rf "$R"; echo "packed ($(since))"; }
trap 'pack; exit 143' TERM INT
# phase NAME ESTIMATE_S: true when the deadline leaves ESTIMATE_S, else says it skipped
phase() { if [ "$(left)" -ge "$2" ]; then echo "== $1 ($(since), $(left) s left)"; else echo "== $1 skipped: $(left) s left, needs $2"; return 1; fi; }
# run a command under the time left (never more than its own cap), its output into a log
timed() { local cap=$1 log=$2; shift 2; local lim; lim=$(left); [ "$lim" -gt "$cap" ] && lim=$cap
  timeout "$lim" "$@" > "$log" 2>&1; local rc=$?; echo "  rc=$rc ($(since)): $*"; return $rc; }

python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null || true
VAR=.ab/var
# DeepGEMM's env.sh puts /tmp/dg first; each tree's own package must come before any other copy
dg_env() { [ -f /tmp/dg/env.sh ] && source /tmp/dg/env.sh; export PYTHONPATH=$PWD/.site:$PWD:/tmp/dg; }
VAR_PP=$PWD/.site:$PWD/$VAR:/tmp/dg
dg_env

for p in ${PHASES:-build suite}; do
  case $p in
  build)
    phase build 60 || break
    (bash .dg/build_deepgemm.sh > "$R/dg_build.log" 2>&1; echo "  deepgemm build rc=$?") &
    if [ -n "${VARIANT_FLAGS:-}" ]; then
      (cd $VAR && CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=7 MEGATRON_TMA_NVCC_EXTRA="$VARIANT_FLAGS" \
        python3 setup.py build_ext --inplace > "$R/build_var.log" 2>&1; echo "  variant build rc=$?") &
    fi
    CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-8} python3 setup.py build_ext --inplace > "$R/build.log" 2>&1
    echo "  build rc=$?"; wait
    ls megatron_tma/_C*.so > /dev/null || { tail -30 "$R/build.log"; break; }
    grep "\[megatron_tma\]" "$R/build.log" | head -3
    dg_env; echo "  builds done ($(since))" ;;
  suite)
    phase suite 200 && { timed 330 "$R/suite.log" python3 -m pytest -q -rs -m "not recipe_run" tests; tail -4 "$R/suite.log"; } ;;
  recipes)
    # caps: on an H100 the recipe set ran past 300 s (the H200 took ~210); give each its own call there
    phase recipes 180 && { timed 480 "$R/recipes.log" python3 -m pytest -v -m recipe_run -k "${RECIPE_K:-not resumes}" tests
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$R/recipes.log" | tail -14; } ;;
  resumes)
    phase resumes 200 && { timed 480 "$R/resumes.log" python3 -m pytest -v -m recipe_run -k resumes tests
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$R/resumes.log" | tail -8; } ;;
  ab)
    phase ab 150 || continue
    ls $VAR/megatron_tma/_C*.so > /dev/null || { echo "  no variant build"; tail -20 "$R/build_var.log"; continue; }
    timed 60 "$R/bits_save.log" python3 lab/gemm_bits.py save "$R/bits_base.pt"
    (cd $VAR && PYTHONPATH=$VAR_PP timeout 60 python3 lab/gemm_bits.py compare "$R/bits_base.pt") \
      > "$R/bits.log" 2>&1; echo "  bits compare rc=$? ($(since))"; tail -3 "$R/bits.log"; rm -f "$R/bits_base.pt"
    (cd $VAR && PYTHONPATH=$VAR_PP timeout 120 python3 -m pytest -q -x tests/test_m_grouped_gpu.py) \
      > "$R/var_tests.log" 2>&1; echo "  variant M-grouped tests rc=$? ($(since))"; tail -2 "$R/var_tests.log"
    for r in $(seq 1 "${ROUNDS:-2}"); do
      order="base var"; [ $((r % 2)) -eq 0 ] && order="var base"
      for t in $order; do
        [ "$(left)" -ge 45 ] || { echo "  round $r $t skipped"; continue; }
        d=.; pp=$PYTHONPATH; [ $t = var ] && { d=$VAR; pp=$VAR_PP; }
        mkdir -p "$R/quick_${t}_r$r"
        (cd $d && PYTHONPATH=$pp timeout 120 python3 benchmarks/bench_m_grouped.py --quick --out "$R/quick_${t}_r$r") \
          > "$R/quick_${t}_r$r.log" 2>&1
        echo "  quick $t round $r rc=$? ($(since))"; grep -iE "geomean|min_vs|same_tile" "$R/quick_${t}_r$r.log" | tail -3
      done
    done ;;
  grids)
    for b in ${BENCHES:-m_grouped:150 k_grouped:230 mlp_layer:150}; do
      name=${b%%:*}; lim=${b#*:}
      phase "grid $name" $(( lim * 2 / 3 )) || continue
      timed "$lim" "$R/bench_$name.log" python3 benchmarks/bench_$name.py --out "$R"
      grep -iE "summary|geomean|wrote" "$R/bench_$name.log" | tail -4
    done ;;
  vargrid)
    phase vargrid 120 || continue
    mkdir -p "$R/var"
    (cd $VAR && PYTHONPATH=$VAR_PP timeout $(left) python3 benchmarks/bench_m_grouped.py --out "$R/var") \
      > "$R/var/bench_m_grouped.log" 2>&1; echo "  variant grid rc=$? ($(since))"; tail -4 "$R/var/bench_m_grouped.log" ;;
  ncu_mg)
    phase ncu_mg 120 || continue
    for t in ${MG_TREES:-base}; do
      d=.; pp=$PYTHONPATH; [ $t = var ] && { d=$VAR; pp=$VAR_PP; }
      for sh in ${MG_SHAPES:-8:65536:6144:5120 32:65536:4096:7168}; do
        log="$R/mg_vs_dg_${t}_${sh//:/_}.log"
        (cd $d && PYTHONPATH=$pp timeout 150 python3 lab/mgrouped_vs_deepgemm.py --shape "$sh" ${MG_ARGS:-}) > "$log" 2>&1
        echo "  $t $sh rc=$? ($(since))"; grep -E "DeepGEMM bits|ours|deepgemm|sustained|block_m" "$log" | cut -c1-260 | head -16
      done
    done
    [ "${MG_NCU:-1}" = 1 ] || continue
    sh=${MG_SHAPES:-8:65536:6144:5120}; sh=${sh%% *}
    timed 200 "$R/ncu_mg.txt" ncu --clock-control none --kernel-name regex:"m_grouped_fp8_gemm_kernel|sm90_fp8_gemm_1d2d" \
      --launch-skip 2 --launch-count 10 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section LaunchStats \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,lts__t_bytes.sum,dram__bytes.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second \
      python3 lab/mgrouped_vs_deepgemm.py --shape "$sh" --iters 0 --calls 1 ;;
  *) echo "unknown phase $p" ;;
  esac
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$R/gpu.csv" 2>&1
pack
