#!/usr/bin/env bash
# Lab: does a change leave existing kernels' machine code alone? Compiles one translation unit under csrc/instantiations
# at a base commit and in the working tree (sm_90a, as .ci/compile_kernels.sh) and compares every kernel's SASS
# instruction by instruction (addresses dropped). Kernels present on one side only are listed; a template argument
# added with a default (`<In, kPow2>` -> `<In, kPow2, false>`) is matched via --rename OLD=NEW on the mangled names.
#   bash lab/sass_diff.sh c0bccf6 quantize [--rename EEEvNS0_21Quantize128x128=ELb0EEEvNS0_21Quantize128x128]
# Needs nvcc, and cuobjdump (the CUDA toolkit's, or triton's copy: triton/backends/nvidia/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
base=$1 unit=$2; shift 2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/base"
git archive "$base" csrc | tar -x -C "$tmp/base"
flags=(-c -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda)
cutlass=$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null || true)
[ -n "$cutlass" ] && flags+=(-I"$cutlass")
(cd "$tmp/base" && nvcc "${flags[@]}" -Icsrc/include "csrc/instantiations/$unit.cu" -o "$tmp/base.o")
nvcc "${flags[@]}" -Icsrc/include "csrc/instantiations/$unit.cu" -o "$tmp/new.o"
python3 - "$tmp/base.o" "$tmp/new.o" "$@" <<'PY'
import re, subprocess, sys
def kernels(obj):
    out = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True, check=True).stdout
    res, cur = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1); res[cur] = []
        elif cur and (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)):
            res[cur].append(re.sub(r"\s+", " ", m.group(1)))
    return res
base, new = kernels(sys.argv[1]), kernels(sys.argv[2])
renames = [a.split("=", 1) for a in sys.argv[4::2]] if "--rename" in sys.argv else []
differ = 0
for name, code in base.items():
    target = name
    for old, repl in renames:
        target = target.replace(old, repl)
    status = "same" if new.get(target) == code else ("gone" if target not in new else "DIFFERENT")
    differ += status != "same"
    print(f"{status:9s} {len(code):5d} {name}")
for name in sorted(set(new) - {n for n in new if any(n == b or any(b.replace(o, r) == n for o, r in renames) for b in base)}):
    print(f"new       {len(new[name]):5d} {name}")
sys.exit(1 if differ else 0)
PY
