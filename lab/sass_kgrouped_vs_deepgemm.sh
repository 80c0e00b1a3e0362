#!/usr/bin/env bash
# Lab, CPU only: the K-grouped wgrad's inner loop in SASS, ours (this tree) against DeepGEMM 2.6.1's (its 1d1d
# kernel, instantiated as its JIT does for G=8 N=K=4096 FP32 out: 128 x 152 x 128, 4 stages, no multicast, with its
# JIT's nvcc flags), via lab/sass_loops.py. Needs nvcc, cuobjdump and nvdisasm (CUOBJDUMP=path if not on PATH), the
# nvidia-cutlass headers (CUTLASS_INCLUDE_DIR, as .ci/compile_kernels.sh) and the DeepGEMM tarball (DG_TGZ, default
# .dg/deepgemm-2.6.1-src.tgz).
#   bash lab/sass_kgrouped_vs_deepgemm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
DG_TGZ=${DG_TGZ:-.dg/deepgemm-2.6.1-src.tgz}
CUTLASS_INC=${CUTLASS_INCLUDE_DIR:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
nvcc -c -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda \
  -DNDEBUG -Icsrc/include -I"$CUTLASS_INC" csrc/instantiations/k_grouped_fp8_gemm.cu -o "$W/ours.o"
"$CUOBJDUMP" -sass "$W/ours.o" > "$W/ours.sass"
echo "== ours (FP32 accumulate: KGroupedOutE2; the loop's body is two 128-token blocks)"
python3 lab/sass_loops.py "$W/ours.sass" KGroupedOutE2 --top 10 | sed -n 2p
tar xzf "$DG_TGZ" -C "$W"
cat > "$W/dg_kg.cu" <<'CU'
#include <deep_gemm/impls/sm90_fp8_gemm_1d1d.cuh>
using namespace deep_gemm;
void* instance() {
  return reinterpret_cast<void*>(&sm90_fp8_gemm_1d1d_impl<4096, 4096, 0, 8, 128, 152, 128, 128, 128, 4, 128, 256, 1,
                                                          false, 132, GemmType::KGroupedContiguous, float>);
}
CU
nvcc -cubin -std=c++20 --diag-suppress=39,161,174,177,186,940 --ptxas-options=--register-usage-level=10 \
  --gpu-architecture=sm_90a -O3 --expt-relaxed-constexpr --expt-extended-lambda -I"$W/dg/deep_gemm/include" \
  -I"$W/dg/third-party/cutlass/include" -I"$W/dg/third-party/fmt/include" "$W/dg_kg.cu" -o "$W/dg_kg.cubin" \
  2> "$W/dg.log" || { cat "$W/dg.log"; exit 1; }  # (its "unroll value cannot be zero" warnings are DeepGEMM's own)
"$CUOBJDUMP" -sass "$W/dg_kg.cubin" > "$W/dg.sass"
echo "== DeepGEMM 2.6.1 (one 128 x 152 block per loop trip)"
python3 lab/sass_loops.py "$W/dg.sass" --top 10 | sed -n 2p
