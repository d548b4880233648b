"""tools/ab_compare.py on the CPU: the timed rows found at any depth of a benchmark JSON, the medians over
rounds of each build, B's speed relative to A, rows missing from a round left out, and --match."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "tools" / "ab_compare.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def row(what, impl, ms):
    return {"what": what, "impl": impl, "timing": {"median_ms": ms, "reps": 10}}


def document(gemm_ms, wgrad_ms, extra=False):
    backward_gemms = {"wgrad_down": [row("wgrad down (dW2)", "pounce fp8", wgrad_ms)]}
    if extra:
        backward_gemms["dgrad_down"] = [row("dgrad down (dy W2)", "pounce", 1.0)]
    return {"environment": {"gpu": "test"},
            "shapes": [{"shape": "deepseek_v3", "forward": [row("forward", "pounce_fused", gemm_ms)],
                        "backward_gemms": backward_gemms}]}


def write_rounds(folder, build, docs):
    for i, doc in enumerate(docs, start=1):
        (folder / f"{build}-{i}.json").write_text(json.dumps(doc))


def test_rows_at_any_depth():
    rows = ab.rows_of(document(9.0, 3.0))
    assert rows == {("deepseek_v3", "forward", "pounce_fused"): 9.0,
                    ("deepseek_v3", "wgrad down (dW2)", "pounce fp8"): 3.0}


def test_medians_ratio_and_rows_of_every_round(tmp_path):
    write_rounds(tmp_path, "A", [document(9.0, 3.0, extra=True), document(9.4, 3.2), document(9.2, 3.1)])
    write_rounds(tmp_path, "B", [document(9.0, 2.0), document(9.1, 2.2), document(9.2, 2.1)])
    lines = ab.compare(ab.rounds(tmp_path, "A"), ab.rounds(tmp_path, "B"))
    assert len(lines) == 3  # the header and two rows: dgrad is not in every round
    wgrad = next(line for line in lines if "wgrad" in line).split()
    assert "3.100" in wgrad and "2.100" in wgrad
    assert f"{3.1 / 2.1:7.3f}x".strip() in wgrad
    assert "6.5%" in wgrad  # A's spread: (3.2 - 3.0) / 3.1


def test_match_keeps_the_named_rows(tmp_path):
    write_rounds(tmp_path, "A", [document(9.0, 3.0)])
    write_rounds(tmp_path, "B", [document(9.0, 2.0)])
    lines = ab.compare(ab.rounds(tmp_path, "A"), ab.rounds(tmp_path, "B"), match=["wgrad"])
    assert len(lines) == 2 and "wgrad" in lines[1]
