#!/usr/bin/env bash
# Lab (one call, <= 8 files back): the one-Function expert-MLP step (megatron_tma.mlp_function) on the GPU -- its
# bits against the composed Functions and the padded twin, the deferral's block-wise combine (b931013, not yet run on
# a GPU) -- then the Qwen3 layer rows with it and with `--composed-step` in the same process's machine (host time A/B,
# issue 52), then the one-pass grid with the FP8 weights written from the FP32 masters (--release-bf16-weights, issues
# 52 and 54's layer rows) in what time is left. TESTS=0 / AB=0 / GRID=0 skip a part.
DEADLINE=${DEADLINE:-560}
source lab/device_call.sh
[ "${TESTS:-1}" = 1 ] && { timeout 130 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_mlp_gpu.py \
  tests/test_wgrad_deferral.py -k "planned_step or padded_twin_is_bit_exact or defer or main_grad" > "$OUT/tests.log" 2>&1
  stamp "tests rc=$?"; tail -2 "$OUT/tests.log"; }
[ "${AB:-1}" = 1 ] && { bench_layer one 110 --models qwen3_30b_a3b; bench_layer composed 110 --models qwen3_30b_a3b --composed-step; }
[ "${GRID:-1}" = 1 ] && bench_layer grid $(( $(left) - 10 )) --release-bf16-weights
