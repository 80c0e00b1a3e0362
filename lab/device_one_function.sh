#!/usr/bin/env bash
# Lab (one call, <= 8 files back): the one-Function expert-MLP step (megatron_tma.mlp_function) on the GPU -- its
# bits against the composed Functions and the padded twin, the deferral's block-wise combine (b931013, not yet run on
# a GPU) -- then the Qwen3 layer rows with it and with `--composed-step` in the same process's machine (host time A/B,
# issue 52), then the one-pass grid with the FP8 weights written from the FP32 masters (--release-bf16-weights, issues
# 52 and 54's layer rows) in what time is left. TESTS=0 / AB=0 / GRID=0 skip a part.
DEADLINE=${DEADLINE:-560}
source lab/device_call.sh
[ "${TESTS:-1}" = 1 ] && { timeout 130 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_mlp_gpu.py \
  tests/test_wgrad_deferral.py -k "one_function or padded_twin_is_bit_exact or defer or main_grad" > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; tail -2 "$OUT/tests.log"; }
bench() {  # $1: a name, $2: its limit, then bench_mlp_layer's options
  local name=$1 limit=$2; shift 2; [ "$(left)" -lt "$limit" ] && limit=$(( $(left) - 5 ))
  [ "$limit" -lt 40 ] && { echo "no time for $name"; return; }
  timeout "$limit" python3 benchmarks/bench_mlp_layer.py --no-graphs "$@" --out "/tmp/b$name" > "/tmp/b$name.log" 2>&1
  stamp "bench $name rc=$?"; grep -E "^\[" "/tmp/b$name.log" | cut -c1-220
  for f in /tmp/b$name/*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name-$(basename "$f")"; done
}
[ "${AB:-1}" = 1 ] && { bench one 110 --models qwen3_30b_a3b; bench composed 110 --models qwen3_30b_a3b --composed-step; }
[ "${GRID:-1}" = 1 ] && { bench grid $(( $(left) - 10 )) --release-bf16-weights; cp /tmp/bgrid.log "$OUT/grid.log"; }
