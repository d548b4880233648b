"""tools/ncu_stalls.py on the CPU, on a small source page in the CSV form Nsight Compute prints: the
tables of two kernels told apart, offsets from each kernel's first instruction, shares of the samples,
the largest stall reasons, and the share inside a span."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_stalls", ROOT / "tools" / "ncu_stalls.py")
ncu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def page():
    return "\n".join([
        '"Kernel Name","first kernel"',
        HEADER,
        '"0x7f0000001000","  NOP","10","0","0","0","0"',
        '"0x7f0000001010","  HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16]","30","10","0","5","0"',
        '"0x7f0000001020","  WARPGROUP.DEPBAR.LE gsb0, 0x1","60","50","60","0","50"',
        '"Kernel Name","second kernel"',
        HEADER,
        '"0x7f0000009000","  EXIT","1,000","0","0","0","0"',
    ])


def test_two_kernels_are_two_tables():
    tables = ncu.kernel_tables(page())
    assert [len(t) for t in tables] == [3, 1]
    assert tables[1][0]["Source"].strip() == "EXIT"
    assert ncu.number(tables[1][0][ncu.SAMPLES]) == 1000  # thousands separators


def test_report_ranks_instructions_and_totals_spans():
    rows = ncu.kernel_tables(page())[0]
    lines = ncu.report(rows, top=2, spans=[("mma", 0x10, 0x20), ("first", 0x0, 0x0)])
    assert lines[0] == "3 instructions, 100 stall samples"
    assert lines[1] == "span mma [10, 20]: 90.0% of samples"
    assert lines[2] == "span first [0, 0]: 10.0% of samples"
    # Ranked by samples, at offsets from the first instruction, with the reasons (not the not-issued copies).
    assert lines[3].split()[:3] == ["20", "60.0%", "WARPGROUP.DEPBAR.LE"]
    assert lines[3].endswith("barrier 60.0%")
    assert lines[4].split()[:2] == ["10", "30.0%"] and lines[4].endswith("long_sb 5.0%")
    assert len(lines) == 5
