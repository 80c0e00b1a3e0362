#!/usr/bin/env bash
# Lab (one short call, ~150 s): the expert MLP's and the released weights' GPU tests (the planned step, the backward's
# wgrad-before-dgrad order), then what is alive at each twin's peak on Qwen3's G = 32, M = 32768 row
# (lab/probe_layer_memory.py, inputs handed over), then the Qwen3 rows of the release grid in what time is left.
DEADLINE=${DEADLINE:-150}
BENCH_LOGS=0
source lab/device_call.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_mlp_gpu.py \
  tests/test_released_weights.py > "$OUT/tests.log" 2>&1; stamp "tests rc=$?"; tail -2 "$OUT/tests.log"
timeout 40 python3 lab/probe_layer_memory.py --model qwen3_30b_a3b --G 32 --M 32768 --release-bf16-weights \
  --handed-inputs > "$OUT/mem.log" 2>&1; stamp "memory probe rc=$?"; cat "$OUT/mem.log" | grep -v Warn | head -40
bench_layer release 200 --release-bf16-weights --models qwen3_30b_a3b
