"""scripts/ffma_yield_patch.py on a synthetic cubin: it finds the ELF image inside a larger blob, touches only the
`.text` sections of the named kernels, only FFMA (all-register form) instructions there, and in those only the
yield bit and the operand-reuse flags of the control word."""
import importlib.util
import os
import struct

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ffma_yield_patch", os.path.join(ROOT, "scripts", "ffma_yield_patch.py"))
patcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patcher)

YIELD, REUSE = 1 << 45, 0xF << 58
FFMA_LO = 0x000000A959DC7223  # FFMA R220, R89, R169, R220
IADD_LO = 0x000000A959DC7210  # another opcode (0x210), same operands


def _elf(sections):
    """A minimal ELF64 image: header, the sections' bytes, a section-name table, the section headers."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name, _ in sections) + b".shstrtab\0"
    body, offsets, name_offs, pos, npos = b"", [], [], 64, 1
    for name, data in sections:
        offsets.append(pos + len(body))
        body += data
        name_offs.append(npos)
        npos += len(name) + 1
    shstr_off = 64 + len(body)
    shoff = shstr_off + len(names)
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    for (name, data), off, noff in zip(sections, offsets, name_offs):
        headers.append(struct.pack("<IIQQQQIIQQ", noff, 1, 6, 0, off, len(data), 0, 0, 128, 0))
    headers.append(struct.pack("<IIQQQQIIQQ", npos, 3, 0, 0, shstr_off, len(names), 0, 0, 1, 0))
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers),
                                 len(headers) - 1)
    return header + body + names + b"".join(headers)


def _text(instructions):
    return b"".join(struct.pack("<QQ", lo, hi) for lo, hi in instructions)


def test_patches_only_the_control_bits_of_ffma_in_the_named_kernels():
    yielding = 0x000FC200000000DC                    # yield bit clear: already yields
    holding = 0x080FE200000000DC                     # yield bit set, reuse flag on operand b
    kernel = [(FFMA_LO, holding), (FFMA_LO, yielding), (IADD_LO, holding), (FFMA_LO, holding | (1 << 52))]
    other = [(FFMA_LO, holding)]
    image = _elf([(".text._Z25m_grouped_fp8_gemm_kernelv", _text(kernel)), (".text._Z5otherv", _text(other)),
                  (".nv.info", b"\xff" * 32)])
    blob = bytearray(b"host object bytes " * 7 + image + b" trailing")
    before = bytes(blob)
    report = patcher.patch(blob, "m_grouped_fp8_gemm_kernel")
    assert report == [("_Z25m_grouped_fp8_gemm_kernelv", 3, 2)]  # 3 FFMA, 2 did not yield yet

    start = before.index(image)
    changed = [i for i in range(len(blob)) if blob[i] != before[i]]
    text = start + 64  # the kernel's section comes first in the image
    words = [struct.unpack_from("<QQ", blob, text + 16 * i) for i in range(len(kernel))]
    assert [lo for lo, _ in words] == [lo for lo, _ in kernel]           # no instruction changed
    assert words[0][1] == holding & ~YIELD & ~REUSE
    assert words[1][1] == yielding                                       # already yielding: untouched
    assert words[2][1] == holding                                        # not an FFMA: untouched
    assert words[3][1] == (holding | (1 << 52)) & ~YIELD & ~REUSE        # other control bits (waits) kept
    assert all(text <= i < text + 16 * len(kernel) for i in changed)     # nothing outside that section


def test_reports_nothing_without_a_matching_kernel():
    blob = bytearray(_elf([(".text._Z5otherv", _text([(FFMA_LO, 0x080FE200000000DC)]))]))
    before = bytes(blob)
    assert patcher.patch(blob, "m_grouped_fp8_gemm_kernel") == []
    assert bytes(blob) == before


def _ffma(dest, a, b):
    """The low word of FFMA R<dest>, R<a>, R<b>, ... (all-register form; operand c sits in the high word)."""
    return 0x7223 | dest << 16 | a << 24 | b << 32


def _patched_words(kernel, mode):
    host = b"host object bytes"  # the scan skips an image at offset 0 (the shared object's own header)
    blob = bytearray(host + _elf([(".text._Z25m_grouped_fp8_gemm_kernelv", _text(kernel))]))
    report = patcher.patch(blob, "m_grouped_fp8_gemm_kernel", mode)
    return report, [struct.unpack_from("<QQ", blob, len(host) + 64 + 16 * i) for i in range(len(kernel))]


def test_noyield_clears_the_yield_hint_of_every_ffma_and_keeps_reuse_flags():
    yielding, holding = 0x000FC200000000DC, 0x080FE200000000DC
    kernel = [(FFMA_LO, yielding), (FFMA_LO, holding), (IADD_LO, yielding)]
    report, words = _patched_words(kernel, "noyield")
    assert report[0][1:] == (2, 1)
    assert words[0] == (FFMA_LO, yielding | YIELD)
    assert words[1] == (FFMA_LO, holding)             # already held, reuse flag kept
    assert words[2] == (IADD_LO, yielding)            # not an FFMA


def test_reuse_chain_caches_operand_b_only_for_an_adjacent_ffma_reading_it_in_the_same_slot():
    plain = 0x000FC200000000DC                         # yields, no reuse flag
    REUSE_B = 1 << 59
    kernel = [
        (_ffma(10, 20, 216), plain),   # next reads R216 as b: cache it, hold the warp
        (_ffma(11, 21, 216), plain),   # next reads R216 as b too
        (_ffma(12, 22, 216), plain),   # next is not an FFMA: untouched
        (IADD_LO, plain),
        (_ffma(13, 23, 217), plain),   # next reads R217 in slot a, not b: untouched
        (_ffma(14, 217, 30), plain),
        (_ffma(217, 24, 217), plain),  # overwrites its own b: the cache would hold the old value: untouched
        (_ffma(15, 25, 217), plain),
        (_ffma(16, 26, 255), plain),   # b is RZ: untouched
        (_ffma(17, 27, 255), plain),   # last instruction of the section: untouched
    ]
    report, words = _patched_words(kernel, "reuse-chain")
    assert report[0][1:] == (9, 2)
    assert [lo for lo, _ in words] == [lo for lo, _ in kernel]
    assert [hi for _, hi in words] == [plain | YIELD | REUSE_B] * 2 + [plain] * 8


def test_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        patcher.patch(bytearray(b"x"), "k", "fast")


def test_reuse_chain_is_idempotent_as_the_build_applies_it_on_every_relink():
    plain = 0x000FC200000000DC
    kernel = [(_ffma(10, 20, 216), plain), (_ffma(11, 21, 216), plain), (_ffma(12, 22, 216), plain)]
    host = b"host object bytes"
    blob = bytearray(host + _elf([(".text._Z25m_grouped_fp8_gemm_kernelv", _text(kernel))]))
    assert patcher.patch(blob, "m_grouped_fp8_gemm_kernel", "reuse-chain")[0][1:] == (3, 2)
    once = bytes(blob)
    assert patcher.patch(blob, "m_grouped_fp8_gemm_kernel", "reuse-chain")[0][1:] == (3, 0)
    assert bytes(blob) == once


def test_build_pattern_names_exactly_the_two_fragment_kernel():
    """setup.py rewrites the kernels matching BUILD_KERNEL_PATTERN. In the sm_90a object that the CI compile check
    builds (.ci/compile_kernels.sh), it must select the one two-fragment 128 x 128 kernel, with its promotion FFMA
    runs, and none of the serial ones (a renamed template would otherwise drop the +3% or slow a serial kernel)."""
    obj = os.path.join(ROOT, ".build-check", "m_grouped_fp8_gemm.o")
    if not os.path.exists(obj):
        if os.environ.get("MEGATRON_TMA_REQUIRE_BUILD_CHECK") == "1":  # CI: its compile check ran first
            pytest.fail(f"{obj} is missing: .ci/compile_kernels.sh did not build it")
        pytest.skip("run .ci/compile_kernels.sh first (CI does, before the tests)")
    with open(obj, "rb") as f:
        blob = bytearray(f.read())
    everything = patcher.patch(bytearray(blob), "m_grouped_fp8_gemm_kernel", "reuse-chain")
    chosen = patcher.patch(bytearray(blob), patcher.BUILD_KERNEL_PATTERN, "reuse-chain")
    assert len(everything) >= 4  # 128 x 128 (two fragments), 128 x 192, 128 x 256, 192 x 128
    assert len(chosen) == 1 and "ILi128ELi5ELi2E" in chosen[0][0]
    assert chosen[0][2] > 100  # the FFMA runs of its promotion were found and rewritten
