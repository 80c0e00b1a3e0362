#!/usr/bin/env bash
# Compile every torch-free kernel translation unit under csrc/instantiations for sm_90a with nvcc, print
# each kernel's registers / stack / spills, and fail on a compile error, on any register spill, when ptxas
# serialises wgmma (warnings C7514-C7518), or when a grouped GEMM's launch register count is not the budget its
# setmaxnreg split assumes.
# Usage: .ci/compile_kernels.sh [PYTHON]   (PYTHON locates the nvidia-cutlass headers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
NVCC=${NVCC:-nvcc}
CUTLASS_INC=${CUTLASS_INCLUDE_DIR:-$("$PY" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
out=.build-check
mkdir -p "$out"
status=0
# check SRC NAME [NVCC FLAGS...]: compile SRC into $out/NAME.o with the checks below; status=1 on a failure.
check() {
  local src=$1 name=$2; shift 2
  local log="$out/$name.ptxas.txt" what="$src${1:+ $*}"
  rm -f "$out/$name.o"  # a failed compile must not leave an older object for the tests that read it
  if ! "$NVCC" -c -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
       --expt-extended-lambda -Xptxas -v -Icsrc/include -I"$CUTLASS_INC" "$@" "$src" -o "$out/$name.o" >"$log" 2>&1; then
    echo "FAIL  $what"; cat "$log"; status=1; return
  fi
  # one line per kernel: demangled-ish name, registers, stack, spills
  awk '/Compiling entry function/ {fn=$(NF-2); gsub(/\x27/, "", fn); sub(/^_ZN12megatron_tma/, "", fn)}
       /bytes stack frame/ {stack=$1; spill_st=$5; spill_ld=$9}
       /Used [0-9]+ registers/ {for (i=1;i<=NF;i++) if ($i=="Used") regs=$(i+1);
         printf "  %-60s regs=%-4s stack=%-5s spill_st=%-4s spill_ld=%s\n", substr(fn,1,60), regs, stack, spill_st, spill_ld}' "$log"
  # The grouped GEMMs' setmaxnreg split (static_asserts in their Configs) assumes the launch gives every thread
  # the whole register file's share, 65536 / threads rounded down to 8: 168 with two math warpgroups, 128 with three.
  # If ptxas allocated fewer, setmaxnreg.inc would wait for registers the pool never holds: a hang on the GPU.
  budget=$(awk '/Compiling entry function/ {fn=$(NF-2)}
       /Used [0-9]+ registers/ && fn ~ /GroupedGemmConfig/ {for (i=1;i<=NF;i++) if ($i=="Used") r=$(i+1);
         want = (fn ~ /Li3EE/) ? 128 : 168; if (r != want) print fn ": " r " registers, launch budget " want}' "$log")
  if [ -n "$budget" ]; then
    echo "$budget"; echo "FAIL  $what: a grouped GEMM's register count is not its setmaxnreg budget"; status=1
  elif grep -Eq "[1-9][0-9]* bytes spill (stores|loads)" "$log"; then
    echo "FAIL  $what spills registers"; status=1
  elif grep -Eq "\(C751[4-8]\)" "$log"; then  # ptxas serialised wgmma (or injected a wait): a silent 2x loss
    grep -E "\(C751[4-8]\)" "$log" | sed 's/ in function.*//'; echo "FAIL  $what serialises wgmma"; status=1
  else
    echo "ok    $what"
  fi
}
for src in csrc/instantiations/*.cu; do
  check "$src" "$(basename "$src" .cu)"
done
# build-time variants kept compiling (and spill-free) for their device A/B: the M-grouped general K loop alone
check csrc/instantiations/m_grouped_fp8_gemm.cu m_grouped_fp8_gemm.general_loop -DMEGATRON_TMA_MG_FIXED_STAGE=0
# ... and the serial tiles in 2-CTA clusters sharing the weight tile (off by default until measured)
check csrc/instantiations/m_grouped_fp8_gemm.cu m_grouped_fp8_gemm.cluster -DMEGATRON_TMA_MG_CLUSTER=1
# the standalone studies under lab/ceiling/ (not built by setup.py): they must keep compiling too
for src in lab/ceiling/*.cu; do
  [ -e "$src" ] || continue
  name=$(basename "$src" .cu)
  if "$NVCC" -c -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc/include \
       -I"$CUTLASS_INC" "$src" -o "$out/$name.o" >"$out/$name.log" 2>&1; then
    echo "ok    $src"
  else
    echo "FAIL  $src"; cat "$out/$name.log"; status=1
  fi
done
exit $status
