# Sourced by the lab's device scripts (repo root of the GPU machine's copy): the carried wheels (.whl) into .site,
# this tree's extension built in place (incremental on a warm machine) beside DeepGEMM's build (.dg; reused when
# the machine kept it), then PYTHONPATH and DeepGEMM's environment set. Logs into $LOGS; returns 1 if the build fails.
#   LOGS=<dir> source lab/device_setup.sh
[ -d .site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD
(bash .dg/build_deepgemm.sh > "$LOGS/dg_build.log" 2>&1; echo "deepgemm build rc=$?") &
CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=14 python3 setup.py build_ext --inplace > "$LOGS/build.log" 2>&1
build_rc=$?
wait
[ $build_rc -eq 0 ] || { tail -30 "$LOGS/build.log"; return 1; }
source /tmp/dg/env.sh
