# Sourced by the lab's single-call device scripts (device_master_fed.sh, device_presets_graphed.sh): $OUT, a deadline
# clock (`left`, `stamp` against $DEADLINE), the carried wheels (.whl) on PYTHONPATH, the GPU named, and the extension
# built in place (DEVICE_REBUILD=0 keeps a build the warm machine already has).
set -uo pipefail
OUT=${OUT:-/tmp/out}; t0=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
stamp() { echo "$1 ($(( $(date +%s) - t0 )) s)"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
if [ "${DEVICE_REBUILD:-1}" = 1 ] || ! python3 -c "import megatron_tma._C" 2>/dev/null; then
  CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 \
    || { tail -40 /tmp/build.log; exit 1; }
fi
stamp built
# One bench_mlp_layer run (eager steps): $1 a name, $2 its limit in seconds (cut to the time left), then its options;
# its JSON and log land in $OUT as <name>-*.json and <name>.log (BENCH_LOGS=0: the JSON only), its row lines are
# echoed.
bench_layer() {
  local name=$1 limit=$2; shift 2; [ "$(left)" -lt "$limit" ] && limit=$(( $(left) - 5 ))
  [ "$limit" -lt 40 ] && { echo "no time for $name"; return; }
  timeout "$limit" python3 benchmarks/bench_mlp_layer.py --no-graphs "$@" --out "/tmp/b$name" > "/tmp/b$name.log" 2>&1
  stamp "bench $name rc=$?"; grep -E "^\[" "/tmp/b$name.log" | cut -c1-200
  for f in /tmp/b$name/*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name-$(basename "$f")"; done
  [ "${BENCH_LOGS:-1}" = 1 ] && cp "/tmp/b$name.log" "$OUT/$name.log"
}
