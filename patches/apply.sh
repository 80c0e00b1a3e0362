#!/usr/bin/env bash
# Adds `--moe-experts-impl megatron_tma-MODE` to Megatron-LM / megatron-core 0.19.x (patches/README.md).
#
#   patches/apply.sh [--check | --reverse] ROOT
#
# ROOT: the folder that holds `megatron/` (a Megatron-LM clone, or the site-packages of a megatron-core 0.19 wheel,
# which ships megatron/training). Checks the version, checks that every hunk applies (`git apply --check`), applies,
# then verifies: the patch reverses cleanly (so all of it is in), the patched files compile. Applied already: says so
# and exits 0. --check: only the checks, nothing written. --reverse: takes the patch out again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
patch_file="$here/megatron-lm-0.19.2-moe-experts-impl.patch"
mode=apply
case "${1:-}" in
  --check) mode=check; shift ;;
  --reverse) mode=reverse; shift ;;
esac
if [ $# -ne 1 ]; then echo "usage: $0 [--check | --reverse] MEGATRON_LM_ROOT" >&2; exit 2; fi
root=$(cd "$1" && pwd)
info="$root/megatron/core/package_info.py"
if [ ! -f "$info" ] || [ ! -f "$root/megatron/training/arguments.py" ]; then
  echo "$root has no megatron/core/package_info.py or megatron/training/arguments.py: not a Megatron-LM root" >&2
  exit 1
fi
version=$(awk '/^(MAJOR|MINOR|PATCH) = [0-9]+/ { printf "%s%s", sep, $3; sep = "." }' "$info")
case "$version" in
  0.19.*) ;;
  *) echo "megatron-core $version at $root: the patch is made for 0.19.x (set MEGATRON_TMA_PATCH_ANY_VERSION=1 to try)" >&2
     [ "${MEGATRON_TMA_PATCH_ANY_VERSION:-0}" = 1 ] || exit 1 ;;
esac
# git apply run inside a work tree takes the paths from the top of that tree and skips those outside the current
# folder; ROOT may sit inside an unrelated repository (a virtual environment in a project), so git looks no higher.
git_apply() { (cd "$root" && GIT_CEILING_DIRECTORIES=$(dirname "$root") git apply "$@" "$patch_file"); }
compiles() {
  local py=${PYTHON:-python3}
  command -v "$py" >/dev/null || return 0
  "$py" - "$root" <<'EOF'
import sys
root = sys.argv[1]
for f in ("arguments.py", "argument_utils.py", "models/gpt.py"):
    path = f"{root}/megatron/training/{f}"
    compile(open(path).read(), path, "exec")
EOF
}

if git_apply --reverse --check 2>/dev/null; then
  case $mode in
    reverse) git_apply --reverse; echo "removed the --moe-experts-impl patch from megatron-core $version at $root" ;;
    *) echo "already applied: megatron-core $version at $root has --moe-experts-impl" ;;
  esac
  exit 0
fi
if [ $mode = reverse ]; then echo "not applied at $root: nothing to reverse" >&2; exit 1; fi
if ! git_apply --check; then
  echo "the patch does not apply to megatron-core $version at $root (files changed locally, or another version)" >&2
  exit 1
fi
if [ $mode = check ]; then echo "applies cleanly to megatron-core $version at $root"; exit 0; fi
git_apply
git_apply --reverse --check   # every hunk is in
compiles
echo "applied to megatron-core $version at $root: pretrain_gpt.py ... --moe-experts-impl megatron_tma-unpadded"
