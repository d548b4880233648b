"""scripts/check_ptxas.py without a compiler: its reading of ptxas -v output (kernels' registers and spills,
every performance-loss note, with or without a kernel named, and injected warpgroup instructions), and a
note or a spill turning into a failing exit."""

import importlib.util
import pathlib
import subprocess

import pytest

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
ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register count at entry
ptxas info    : (C7509) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the presence \
of Extern calls in the function '_Z5cleanv'
ptxas info    : (C7519) warpgroup.arrive is injected in around line 41419 by compiler to allow use of registers in \
GMMA in function '_Z6kernelILi3EEvv'
"""


def test_parse_reads_spills_registers_and_every_performance_loss_note():
    kernels, losses = check_ptxas.parse(LOG)
    assert kernels["_Z6kernelILi3EEvv"] == {"stack": 136, "spill_stores": 248, "spill_loads": 488, "registers": 168}
    assert kernels["_Z5cleanv"] == {"stack": 0, "spill_stores": 0, "spill_loads": 0, "registers": 40}
    assert [(note, kernel) for note, _, kernel in losses] == [
        ("C7514", "_Z6kernelILi3EEvv"), ("C7508", None), ("C7509", "_Z5cleanv"), ("C7519", "_Z6kernelILi3EEvv")
    ]


def test_outputs_go_to_the_given_object_and_no_dependency_file():
    argv = ["nvcc", "-DX", "-MD", "-MT", "a.o", "-MF", "a.o.d", "-x", "cu", "-c", "a.cu", "-o", "a.o"]
    assert check_ptxas.without_outputs(argv, "scratch-dir/1.o") == [
        "nvcc", "-DX", "-x", "cu", "-c", "a.cu", "-o", "scratch-dir/1.o", "-Xptxas", "-v"
    ]


def test_a_note_or_a_spill_fails_the_check(monkeypatch, tmp_path, capsys):
    """main() over a stubbed build: one source whose ptxas output has a performance-loss note, and the
    grouped GEMM's source with a spilling kernel; both are named and the exit code is 1."""
    sources = {"k.cu": LOG, "src/gemm/grouped_gemm.cu": LOG.split("ptxas info    : (C7508)")[0]}

    def run(argv, **kwargs):
        if argv[:2] == ["ninja", "-C"]:
            lines = [f"/usr/local/cuda/bin/nvcc -c {s} -o CMakeFiles/pounce.dir/{i}.o" for i, s in enumerate(sources)]
            return subprocess.CompletedProcess(argv, 0, "\n".join(lines), "")
        if argv[0].endswith("c++filt"):
            return subprocess.CompletedProcess(argv, 0, kwargs["input"], "")
        return subprocess.CompletedProcess(argv, 0, "", sources[argv[argv.index("-c") + 1]])

    monkeypatch.setattr(check_ptxas.subprocess, "run", run)
    monkeypatch.setattr(check_ptxas.sys, "argv", ["check_ptxas.py", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        check_ptxas.main()
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "k.cu: ptxas C7514 in _Z6kernelILi3EEvv" in out and "C7508 in a kernel" in out
    assert "src/gemm/grouped_gemm.cu: _Z6kernelILi3EEvv spills 248 bytes" in out
