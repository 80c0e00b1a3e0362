#!/usr/bin/env bash
# Lab: one device call for the K-grouped probe: build, bits/accuracy cases (also under memcheck), timing, ncu.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 120 python3 lab/kgrouped_probe.py 2>&1 | tee "$OUT/probe_check.log" | tail -12
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 lab/kgrouped_probe.py > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|ALL OK|FAILED" "$OUT/memcheck.log" | head -3
timeout 200 python3 lab/kgrouped_probe.py --no-check --time "$@" 2>&1 | tee "$OUT/probe_time.log" | tail -20
if [ "${NCU:-1}" = 1 ]; then
  timeout 150 ncu --set full --import-source no -k regex:k_grouped --launch-skip 3 --launch-count 1 -o "$OUT/kg" \
    python3 lab/kgrouped_probe.py --no-check --time --iters 1 --shapes ${NCU_SHAPE:-8:32768:4096:7168} > "$OUT/ncu.log" 2>&1
  ncu -i "$OUT/kg.ncu-rep" --page source --csv --print-source sass > "$OUT/kg_sass.csv" 2>/dev/null
  python3 lab/ncu_sass_summary.py "$OUT/kg_sass.csv" --top 22 2>&1 | head -40
  ncu -i "$OUT/kg.ncu-rep" --page details --csv 2>/dev/null | grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|Issue Slots Busy|Executed Ipc A|No Eligible|Registers Per" | cut -c1-200 | head -14
fi
