"""Opcode counts of the wgmma loops in a cuobjdump SASS listing: for every backward branch whose body holds a
(Q/H)GMMA, the body's length and its most frequent opcodes (predicates and modifiers stripped). The innermost loop
of a grouped GEMM is the first such loop printed and the shortest; its length per K block is the kernel's issue
cost per block and warp, a number to hold two kernels (or two builds) to without a GPU.

    cuobjdump -sass kernel.o > k.sass && python lab/sass_loops.py k.sass [FUNCTION_SUBSTRING] [--top 12]
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_sass_summary import opcode  # noqa: E402  (`@!P0 UIADD3.X UR4, ...` -> `UIADD3`)

_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def functions(sass: str):
    """(name, [(address, instruction text)]) per function of the listing."""
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        yield name, [(int(m.group(1), 16), m.group(2)) for m in map(_INS.match, chunk.split("\n")) if m]


def gmma_loops(instructions):
    """[(start address, body)] for each backward branch whose body (target .. branch) holds a GMMA."""
    index = {a: i for i, (a, _) in enumerate(instructions)}
    loops = []
    for i, (addr, text) in enumerate(instructions):
        m = _BRA.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            body = [t for _, t in instructions[index[target]: i + 1]]
            if any("GMMA" in t for t in body):
                loops.append((target, body))
    return loops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("function", nargs="?", default="", help="only functions whose mangled name contains this")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    for name, instructions in functions(open(args.sass).read()):
        if args.function not in name:
            continue
        print(name)
        for start, body in sorted(gmma_loops(instructions), key=lambda lb: len(lb[1])):
            counts = collections.Counter(map(opcode, body))
            gmma = sum(n for op, n in counts.items() if op.endswith("GMMA"))
            print(f"  loop at {start:#x}: {len(body)} instructions, {gmma} GMMA; "
                  + " ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))


if __name__ == "__main__":
    main()
