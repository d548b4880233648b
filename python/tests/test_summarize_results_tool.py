"""scripts/summarize_results.py on the CPU: the grouped-GEMM fractions computed from a benchmark JSON (each
GEMM over the dense GEMM of its own comparison, padding rows counted per shape) and the full summary
printed from one."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("summarize_results", ROOT / "scripts" / "summarize_results.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


def timed(impl, tflops):
    return {"what": "step", "impl": impl, "tflops": tflops, "timing": {"median_ms": 1.0, "reps": 10}}


def shape(name, routes, padded, bf16, dense, fp8=None, dense_fp8=None):
    s = {"shape": name, "routes": routes, "padded_rows": padded,
         "grouped_gemms": {"gemm1_gate_up": [timed("pounce (SwiGLU fused)", bf16[0]), timed(summarize.DENSE, dense)],
                           "gemm2_down": [timed("pounce", bf16[1]), timed(summarize.DENSE, dense)]}}
    if fp8:
        s["grouped_gemms_fp8"] = {
            key: {"rows": [timed("pounce fp8", rate), timed("cublasLt dense fp8 8192^3 (fast accumulation)", dense_fp8)]}
            for key, rate in zip(("gemm1_gate_up", "gemm2_down"), fp8)}
    return s


def test_fractions_use_each_comparisons_own_dense_gemm():
    bench = {"shapes": [shape("a", 1000, 1024, (660, 600), 600, fp8=(1200, 900), dense_fp8=1500),
                        shape("b", 2048, 2048, (500, 450), 500)]}
    got = {(r["shape"], r["gemm"]): r for r in summarize.gemm_fractions(bench)}
    assert got["a", "GEMM1"]["bf16_of_dense"] == pytest.approx(1.1) and got["a", "GEMM2"]["bf16_of_dense"] == 1.0
    assert got["a", "GEMM1"]["e4m3_of_dense"] == pytest.approx(0.8)
    assert got["a", "GEMM2"]["e4m3_of_dense"] == pytest.approx(0.6)
    assert got["a", "GEMM1"]["padding_rows"] == 24 and got["b", "GEMM2"]["padding_rows"] == 0
    assert got["b", "GEMM1"]["e4m3_tflops"] is None  # no E4M3 GEMMs on that shape


def test_summary_of_a_recorded_run_prints_the_gemm_table(tmp_path, capsys, monkeypatch):
    recorded = json.loads((ROOT / "results/archive/h200/2026-12-03-f3284ee-gpu-check.json").read_text())
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(recorded["bench_balanced"]))
    monkeypatch.setattr("sys.argv", ["summarize_results.py", str(path)])
    summarize.main()
    out = capsys.readouterr().out
    assert "| deepseek_v3 | GEMM2 | 0 | 675 | 1.005 | 939 | 0.712 |" in out
    assert "| kimi_k2 | GEMM1 | 2048 |" in out


def test_backward_gemm_table_prints_each_weight_gradient_output(capsys):
    step = {"pounce backward, from the kept forward": 500, "pounce backward, replay (plans, recomputes GEMM1)": 400,
            summarize.DENSE: 625}
    s = {"shape": "a", "backward": [timed(i, r) for i, r in step.items()],
         "training_forward": [timed("pounce fused forward", 600),
                              timed("pounce fused training forward (keeps gate/up)", 550)],
         "forward_backward": [timed("pounce fused training forward + backward from it", 520),
                              timed("pounce fused forward + backward replay", 450)],
         "backward_memory": {"kept_bytes_per_token": 1000},
         "backward_gemms": {key: [timed("pounce", 500), timed(summarize.DENSE, 625)] +
                            ([timed("cublas_loop", 250)] if key != "gemm1_again" else []) +
                            ([timed("pounce bf16 out", 600), timed("pounce fp32 accumulated", 450)]
                             if key.startswith("wgrad") else [])
                            for key in ("gemm1_again", "dgrad_down", "dgrad_gate_up", "wgrad_down", "wgrad_gate_up")}}
    summarize.backward_table({"shapes": [s]}, {})
    out = capsys.readouterr().out
    wgrad = "500 (0.80), 2.00x; bf16 out 0.96; accumulated 0.72"
    assert f"| a | 500 (0.80) | 500 (0.80), 2.00x | 500 (0.80), 2.00x | {wgrad} | {wgrad} |" in out
