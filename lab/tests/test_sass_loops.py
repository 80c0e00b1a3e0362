"""lab/sass_loops.py on a synthetic cuobjdump listing: only backward branches whose body holds a GMMA count as loops,
opcodes lose their predicates and modifiers, and a function filter picks the listing's functions by name."""
import importlib.util
import os

LAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("sass_loops", os.path.join(LAB, "sass_loops.py"))
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

LISTING = """
\t\tFunction : _Z6kernelA
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x0 */
        /*0010*/                   UIADD3 UR4, UR5, 0x1, URZ ;                            /* 0x0 */
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;   /* 0x0 */
        /*0030*/                   FFMA R2, R3, R4, R2 ;                                  /* 0x0 */
        /*0040*/              @!P0 BRA 0x10 ;                                             /* 0x0 */
        /*0050*/                   FADD R2, R2, R3 ;                                      /* 0x0 */
        /*0060*/              @!P1 BRA 0x50 ;                                             /* 0x0 */
        /*0070*/                   EXIT ;                                                 /* 0x0 */
\t\tFunction : _Z6kernelB
        /*0000*/                   FFMA R2, R3, R4, R2 ;                                  /* 0x0 */
        /*0010*/                   BRA 0x0 ;                                              /* 0x0 */
"""


def test_opcode_strips_predicates_and_modifiers():
    assert sass_loops.opcode("@!P0 BRA 0x10") == "BRA"
    assert sass_loops.opcode("@!UP1 UIADD3.X UR4, UR5, 0x1, URZ") == "UIADD3"
    assert sass_loops.opcode("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24") == "QGMMA"


def test_only_backward_branches_around_a_gmma_are_loops():
    funcs = dict(sass_loops.functions(LISTING))
    assert set(funcs) == {"_Z6kernelA", "_Z6kernelB"}
    loops = sass_loops.gmma_loops(funcs["_Z6kernelA"])
    assert [(start, len(body)) for start, body in loops] == [(0x10, 4)]  # the FADD loop holds no GMMA
    assert sass_loops.gmma_loops(funcs["_Z6kernelB"]) == []


def test_main_prints_the_filtered_functions_loops(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(LISTING)
    sass_loops.main([str(path), "kernelA"])
    out = capsys.readouterr().out
    assert "_Z6kernelB" not in out
    assert "loop at 0x10: 4 instructions, 1 GMMA;" in out and "UIADD3 1" in out
