#!/usr/bin/env bash
# A/B of the promotion FFMAs' scheduling hints and of a ptxas option, on one GPU machine, in one call:
#   base         the extension as setup.py builds it
#   <mode>       the same .so with scripts/ffma_yield_patch.py --mode <mode> applied to the M-grouped kernels
#   base again   (drift check: the machine state moves a few % between processes)
#   rul10        rebuilt with -Xptxas=--register-usage-level=10 (DeepGEMM builds with it)
# Each variant: its outputs against the base build's, bit for bit (scripts/gemm_bits.py), then
# `bench_m_grouped.py --quick` (five rows; dense cuBLAS in the same process, so ours / dense compares across
# processes). Summary table last. Usage (GPU machine, repo root, wheels installed as gpu_session.sh does):
#   bash benchmarks/tune_ffma_hints.sh [mode ...]        (default: noyield reuse-chain)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/ffma"
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(noyield reuse-chain)
build() {
  local t0=$(date +%s)
  CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/ffma/build_$1.log" 2>&1 \
    || { echo "build $1 failed"; tail -30 "$OUT/ffma/build_$1.log"; exit 1; }
  echo "build $1: $(( $(date +%s) - t0 )) s"
}
bench() {  # name
  python3 scripts/gemm_bits.py compare "$OUT/ffma/bits.pt" 2>&1 | tail -1 | sed "s/^/bits $1: /"
  python3 benchmarks/bench_m_grouped.py --quick --out "$OUT/ffma/$1" > "$OUT/ffma/bench_$1.log" 2>&1 \
    || { echo "bench $1 failed"; tail -20 "$OUT/ffma/bench_$1.log"; }
}
build base
so=$(ls megatron_tma/_C*.so)
cp "$so" /tmp/base.so
python3 scripts/gemm_bits.py save "$OUT/ffma/bits.pt"
bench base
for m in "${modes[@]}"; do
  cp /tmp/base.so "$so"
  python3 scripts/ffma_yield_patch.py "$so" --mode "$m" --kernel m_grouped_fp8_gemm_kernel | sed "s/^/patch $m: /"
  bench "$m"
done
cp /tmp/base.so "$so"
bench base2
MEGATRON_TMA_NVCC_EXTRA="-Xptxas=--register-usage-level=10" build rul10
bench rul10
python3 - "$OUT/ffma" base "${modes[@]}" base2 rul10 <<'EOF'
import glob, json, math, sys
root, names = sys.argv[1], sys.argv[2:]
rows = {}
for n in names:
    f = sorted(glob.glob(f"{root}/{n}/m_grouped-*.json"))
    if f:
        rows[n] = json.load(open(f[-1]))["rows"]
print("ours TFLOPS / ours over dense cuBLAS (same process), five --quick rows; geomean of ours/dense last")
for n, rs in rows.items():
    cells = " ".join(f"{r['ours_tflops']:6.0f}/{r['ratio_vs_dense_cublas']:.3f}" for r in rs)
    g = math.exp(sum(math.log(r["ratio_vs_dense_cublas"]) for r in rs) / len(rs))
    print(f"{n:12s} {cells}  geo {g:.4f}")
EOF
