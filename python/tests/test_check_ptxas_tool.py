"""scripts/check_ptxas.py's reading of ptxas -v output, without a compiler: kernels' registers and spills,
and the notes that say ptxas serialized a kernel's wgmma instructions."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_ptxas", ROOT / "scripts" / "check_ptxas.py")
check_ptxas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_ptxas)

LOG = """\
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function \
'_Z6kernelILi3EEvv'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelILi3EEvv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelILi3EEvv
    136 bytes stack frame, 248 bytes spill stores, 488 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 136 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z5cleanv' for 'sm_90a'
ptxas info    : Function properties for _Z5cleanv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_parse_reads_spills_registers_and_serialized_wgmmas():
    kernels, serialized = check_ptxas.parse(LOG)
    assert kernels["_Z6kernelILi3EEvv"] == {"stack": 136, "spill_stores": 248, "spill_loads": 488, "registers": 168}
    assert kernels["_Z5cleanv"] == {"stack": 0, "spill_stores": 0, "spill_loads": 0, "registers": 40}
    assert [(note, kernel) for note, _, kernel in serialized] == [("C7514", "_Z6kernelILi3EEvv")]


def test_outputs_go_to_the_given_object_and_no_dependency_file():
    argv = ["nvcc", "-DX", "-MD", "-MT", "a.o", "-MF", "a.o.d", "-x", "cu", "-c", "a.cu", "-o", "a.o"]
    assert check_ptxas.without_outputs(argv, "/tmp/1.o") == [
        "nvcc", "-DX", "-x", "cu", "-c", "a.cu", "-o", "/tmp/1.o", "-Xptxas", "-v"
    ]
