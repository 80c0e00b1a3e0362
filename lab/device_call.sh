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
