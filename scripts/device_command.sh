#!/usr/bin/env bash
# Print the command line to hand to the GPU machine for a session on the current commit. The machine gets a
# copy of the working tree without .git, so benchmark results learn their commit from MEGATRON_TMA_COMMIT;
# this fills it in from HEAD (typing it by hand has produced results labelled with the wrong commit), and
# refuses while tracked files differ from HEAD, since the results must name the code that ran.
#   usage: bash scripts/device_command.sh [pytest args] -- [bench ...]    (arguments of gpu_session.sh)
#   e.g.   SANITIZE=1 bash scripts/device_command.sh tests -- quant mlp_layer
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "device_command: tracked files differ from HEAD; commit first so that results name the code that ran" >&2
  git status --short --untracked-files=no >&2
  exit 1
fi
envs="MEGATRON_TMA_COMMIT=$(git rev-parse --short=7 HEAD)"
for v in SANITIZE TEST_TIMEOUT BENCH_TIMEOUT; do
  [ -n "${!v:-}" ] && envs="$envs $v=${!v}"
done
echo "$envs bash scripts/gpu_session.sh $*"
