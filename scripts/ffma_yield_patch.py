"""Build step (setup.py runs it after every CUDA build): rewrite the scheduling control bits of the promotion FFMAs
in the built extension. Its other modes are the experiments that chose `reuse-chain` (lab/tune_ffma_hints.sh).

DeepGEMM reports (README, "FFMA SASS interleaving") that letting the warp yield on the promotion FFMAs, which
also means giving up their operand-reuse flag, overlaps them better with the tensor cores (+10% on some
shapes of its FP8 GEMM). ptxas already sets the yield hint on every other promotion FFMA of our kernels; this
script sets it on the others too. It changes no instruction, only hints: the numerics cannot change, and the
GPU tests check the bits anyway.

Each SM90 instruction is 16 bytes; the high 8 bytes carry the control word: stall count bits 41-44, the
yield bit 45 (0 = may yield), barriers 46-57, operand-reuse flags 58-61. FFMA (all-register form) has
opcode 0x223 in bits 0-11 of the low word. Embedded cubins are found by their ELF headers inside the
(uncompressed) fatbin of the shared object; only `.text.<kernel>` sections whose name contains the pattern
are touched.

Modes (--mode):
  yield        every FFMA may yield; its reuse flags dropped (a yielding warp may not keep the reuse cache)
  noyield      no FFMA yields; reuse flags as ptxas set them
  reuse-chain  no yield on an FFMA whose next instruction is an FFMA reading the same register as its operand b
               (the promotion's scale), and the reuse flag set on that operand, so the next one reads it from the
               reuse cache: two register-file reads per promotion FFMA instead of three on every other one
               (the register-bank hypothesis, benchmarks/NOTES.md). Only adjacent instructions are paired, and
               the reuse flag is only set where the next instruction reads the same register in the same slot,
               which is the flag's contract.

    python scripts/ffma_yield_patch.py megatron_tma/_C*.so [--mode yield] [--kernel m_grouped_fp8_gemm_kernel]
                                       [--dry-run]

Measured (benchmarks/NOTES.md, M-grouped table): `yield` made the m-grouped kernel 3-5% slower (1db5c8f),
`noyield` 3-9% slower, `reuse-chain` 3.1% faster (geomean of the five reference rows of docs/design.md §5, four alternating processes
per build, same bits: lab/tune_ffma_hints.sh at bf172b0). setup.py applies `reuse-chain` to the M-grouped
kernels after every build (MEGATRON_TMA_FFMA_HINTS=none skips it).
"""
import argparse
import struct
import sys

YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58


def _cubins(blob):
    """(start, end) of every ELF64 image embedded in blob after its first byte (the cubins)."""
    pos = blob.find(b"\x7fELF", 1)
    while pos != -1:
        if blob[pos + 4] == 2:  # ELFCLASS64
            e_shoff, = struct.unpack_from("<Q", blob, pos + 0x28)
            e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", blob, pos + 0x3A)
            end = pos + e_shoff + e_shentsize * e_shnum
            if e_shentsize == 64 and 0 < e_shnum < 65536 and end <= len(blob):
                yield pos, e_shoff, e_shnum, e_shstrndx
        pos = blob.find(b"\x7fELF", pos + 1)


def _text_sections(blob, base, e_shoff, e_shnum, e_shstrndx):
    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", blob, base + e_shoff + 64 * i)
    strtab_off = header(e_shstrndx)[4]
    for i in range(e_shnum):
        name_off, _, _, _, off, size, *_ = header(i)
        end = blob.index(b"\0", base + strtab_off + name_off)
        name = blob[base + strtab_off + name_off:end].decode("ascii", "replace")
        if name.startswith(".text."):
            yield name[len(".text."):], base + off, size


REUSE_B = 1 << 59  # operand b (bits 32-39 of the low word in the all-register FFMA form)
MODES = ("yield", "noyield", "reuse-chain")
# What setup.py rewrites after every build: the two-fragment 128 x 128 M-grouped kernel (MGroupedGemmConfig<128, 5,
# 2>) only. reuse-chain measured +3% there; on the serial kernels, whose other warpgroups need issue slots during
# a run of FFMAs, it cost 4-7% (benchmarks/NOTES.md). tests/test_ffma_yield_patch.py checks it names one kernel.
BUILD_KERNEL_PATTERN = "m_grouped_fp8_gemm_kernelINS_18MGroupedGemmConfigILi128ELi5ELi2EE"


def _is_ffma(lo):
    return lo & 0xFFF == 0x223


def _rewrite(lo, hi, next_lo, mode):
    """The new control word of one FFMA (lo, hi) followed by the instruction next_lo (None at the end)."""
    if mode == "yield":
        return hi & ~YIELD_BIT & ~REUSE_BITS if hi & YIELD_BIT else hi
    if mode == "noyield":
        return hi | YIELD_BIT
    reg_b, dest = (lo >> 32) & 0xFF, (lo >> 16) & 0xFF
    if (next_lo is not None and _is_ffma(next_lo) and reg_b not in (0xFF, dest)  # RZ is no register; an FFMA
            and (next_lo >> 32) & 0xFF == reg_b):                                  # that overwrites b must not cache it
        return hi | YIELD_BIT | REUSE_B
    return hi


def patch(blob, kernel_pattern, mode="yield"):
    """Returns [(kernel, ffma count, patched count)]; modifies blob (a bytearray) in place."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    report = []
    for base, e_shoff, e_shnum, e_shstrndx in _cubins(blob):
        for name, off, size in _text_sections(blob, base, e_shoff, e_shnum, e_shstrndx):
            if kernel_pattern not in name or size % 16:
                continue
            ffma = patched = 0
            for at in range(off, off + size, 16):
                lo, hi = struct.unpack_from("<QQ", blob, at)
                if not _is_ffma(lo):
                    continue
                ffma += 1
                next_lo = struct.unpack_from("<Q", blob, at + 16)[0] if at + 16 < off + size else None
                new_hi = _rewrite(lo, hi, next_lo, mode)
                if new_hi != hi:
                    struct.pack_into("<Q", blob, at + 8, new_hi)
                    patched += 1
            report.append((name, ffma, patched))
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="the built extension (.so) or an object file with an embedded cubin")
    ap.add_argument("--kernel", default="m_grouped_fp8_gemm_kernel", help="substring of the kernels to patch")
    ap.add_argument("--mode", choices=MODES, default="yield", help="which hints to rewrite (see above)")
    ap.add_argument("--dry-run", action="store_true", help="count, write nothing")
    args = ap.parse_args()
    blob = bytearray(open(args.path, "rb").read())
    report = patch(blob, args.kernel, args.mode)
    for name, ffma, patched in report:
        print(f"{name[:90]}: {ffma} FFMA, {patched} rewritten ({args.mode})")
    if not report or not any(p for _, _, p in report):
        print("nothing patched (no matching kernel, or a compressed fatbin)", file=sys.stderr)
        return 1
    if not args.dry_run:
        open(args.path, "wb").write(blob)
    return 0


if __name__ == "__main__":
    sys.exit(main())
