#!/usr/bin/env bash
# Lab (one call, ~3-4 minutes): the M-grouped grid's worst row against the padded GEMM (H100 grid 20261205-0825, row 9:
# G=8 M=65536 N=6144 K=5120 paper, x0.860) re-timed in alternating blocks beside its neighbours, then both kernels on
# the same data under ncu (clocks locked at base: the power limit out of the comparison). ROWS overrides the rows.
DEADLINE=${DEADLINE:-300}
source lab/device_call.sh
ROWS=${ROWS:-9,10,11,21,0}
timeout 150 python3 lab/time_m_grouped_rows.py --grid-rows "$ROWS" --padded-gemm --repeat 3 > "$OUT/retime.json" 2>&1
stamp "retime rc=$?"; cat "$OUT/retime.json" | cut -c1-1500
timeout $(( $(left) - 5 )) ncu --kernel-name regex:m_grouped --launch-count 4 --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
  python3 lab/time_m_grouped_rows.py --grid-rows "${ROWS%%,*}" --padded-gemm --profile-calls 2 > "$OUT/ncu.csv" 2>&1
stamp "ncu rc=$?"; grep -E '"(Duration|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|SM Frequency)"' \
  "$OUT/ncu.csv" | awk -F'","' '{print $1 " | " $(NF-2) " " $NF}' | cut -c1-40,200- | head -30
