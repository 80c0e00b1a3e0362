#!/usr/bin/env bash
# A/B of post-build changes to the M-grouped kernel, on one GPU machine, in one call:
#   base          the extension as setup.py builds it, without its FFMA hint rewrite (MEGATRON_TMA_FFMA_HINTS=none)
#   <mode>        base with scripts/ffma_yield_patch.py --mode <mode> applied to the M-grouped kernels
#   rul10         rebuilt with -Xptxas=--register-usage-level=10 (DeepGEMM builds with it)
#   rul10+<mode>  both
# Every variant's outputs are first compared with the base build's, bit for bit (lab/gemm_bits.py). Then the
# variants are timed in alternation, ROUNDS processes each in rotated order (lab/time_m_grouped_rows.py:
# `ours` on the five reference rows (docs/design.md §5)), because the same build moves by a few % between processes; the summary gives
# each variant's per-row median and its geomean against base.
#   usage (GPU machine, repo root, wheels on PYTHONPATH): ROUNDS=4 bash lab/tune_ffma_hints.sh [mode ...]
#   (default mode: reuse-chain)
set -uo pipefail
OUT=${OUT:-/tmp/out}
D="$OUT/ffma"
mkdir -p "$D" /tmp/variants
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(reuse-chain)
build() {  # name [extra nvcc flags]
  local t0=$(date +%s)
  MEGATRON_TMA_FFMA_HINTS=none MEGATRON_TMA_NVCC_EXTRA="${2:-}" CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace \
    > "$D/build_$1.log" 2>&1 || { echo "build $1 failed"; tail -30 "$D/build_$1.log"; exit 1; }
  cp megatron_tma/_C*.so "/tmp/variants/$1.so"
  echo "build $1: $(( $(date +%s) - t0 )) s"
}
build base
so=$(ls megatron_tma/_C*.so)
build rul10 "-Xptxas=--register-usage-level=10"
variants=(base rul10)
for m in "${modes[@]}"; do
  for b in base rul10; do
    cp "/tmp/variants/$b.so" "/tmp/variants/$b+$m.so"
    python3 scripts/ffma_yield_patch.py "/tmp/variants/$b+$m.so" --mode "$m" | sed "s/^/patch $b+$m: /" | cut -c1-140
    variants+=("$b+$m")
  done
done
cp /tmp/variants/base.so "$so"
python3 lab/gemm_bits.py save "$D/bits.pt"
for v in "${variants[@]}"; do
  cp "/tmp/variants/$v.so" "$so"
  python3 lab/gemm_bits.py compare "$D/bits.pt" 2>&1 | tail -1 | sed "s/^/bits $v: /"
done
source lab/ab_rounds.sh
time_rotated /tmp/variants "$so" "${ROUNDS:-4}" "${variants[@]}"
cp /tmp/variants/base.so "$so"
python3 lab/ab_summary.py "$D/times.jsonl" base
