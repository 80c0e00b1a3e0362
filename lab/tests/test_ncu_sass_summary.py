"""lab/ncu_sass_summary.py on a synthetic ncu SASS source page: predicates and modifiers are stripped from the
opcode, every numeric column is summed per opcode, and the shares printed are of each column's total."""
import importlib.util
import os
import sys

LAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ncu_sass_summary", os.path.join(LAB, "ncu_sass_summary.py"))
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

PAGE = '''"Kernel Name","void k()",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Address Space"
"0x7f00","      FFMA R1, R2, R3, R1","30","100","-"
"0x7f10","      FFMA.FTZ R4, R2, R3, R4","10","100","-"
"0x7f20","      @!P0  BRA 0x7f00","50","25","-"
"0x7f30","      @P1   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2","10","25","-"
'''


def test_opcode_strips_predicates_and_modifiers():
    assert summary.opcode("      @!P0  BRA 0x7f00") == "BRA"
    assert summary.opcode("@UP1 UIADD3 UR4, UR5, 0x1, URZ") == "UIADD3"
    assert summary.opcode("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT") == "QGMMA"
    assert summary.opcode("   ") == "?"


def test_sums_per_opcode_as_shares_of_each_column(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sass.csv"
    path.write_text(PAGE)
    monkeypatch.setattr(sys, "argv", ["ncu_sass_summary.py", str(path), "--columns", "2"])
    summary.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 SASS lines; totals: Instructions Executed = 250; Warp Stall Sampling (All Samples) = 100")
    rows = {line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:]] for line in lines[2:]}
    assert rows["FFMA"] == [80.0, 40.0]   # 200 of 250 instructions, 40 of 100 samples
    assert rows["BRA"] == [10.0, 50.0]
    assert rows["SYNCS"] == [10.0, 10.0]
    assert list(rows) == ["FFMA", "BRA", "SYNCS"]  # ordered by the first column shown
