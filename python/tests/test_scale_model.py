"""tools/scale_model.py on the CPU: the model's invariants, and that its calibration reproduces the
committed measurements within the error it states."""

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location("scale_model", ROOT / "tools" / "scale_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sm = load_tool()


@pytest.fixture(scope="module")
def calibrated():
    model, points = sm.calibrate(sm.Measured())
    return model, points, sm.errors(model, points)


def with_fabric(model, **changes):
    return sm.Model(model.m, replace(model.fabric, **changes), model.fit)


def ep_cases(model, sizes=sm.EP_SIZES):
    for shape in model.m.shapes.values():
        for P in sizes:
            if shape.model_experts % P == 0:
                yield model.ep_case(shape, P)


def test_one_rank_moves_no_remote_bytes(calibrated):
    model, _, _ = calibrated
    for case in ep_cases(model, sizes=(1,)):
        assert model.route_split(case) == (1.0, 0.0, 0.0)
        assert model.latency_ms(case) == 0.0
        assert model.unfused(case)["phases_ms"]["dispatch all-to-all"] == 0.0
        # No link is used, so no link rate can change the prediction.
        for other in (
            with_fabric(model, nvlink_gbps=1.0, net_gbps=1.0),
            with_fabric(model, nvlink_gbps=1e5, net_gbps=1e5),
        ):
            assert other.fused(case)["ms"] == pytest.approx(model.fused(case)["ms"], rel=1e-12)
            assert other.unfused(case)["ms"] == pytest.approx(model.unfused(case)["ms"], rel=1e-12)


def test_remote_shares_add_up(calibrated):
    model, _, _ = calibrated
    for case in ep_cases(model):
        local, nvlink, network = model.route_split(case)
        assert local + nvlink + network == pytest.approx(1.0)
        assert (network > 0) == (case.ranks > model.fabric.gpus_per_node)


def test_more_bandwidth_never_predicts_slower(calibrated):
    model, _, _ = calibrated
    rates = [(nv, net) for nv, net in zip((100, 225, 450, 900, 1800), (12.5, 25, 50, 100, 200))]
    for case in ep_cases(model):
        # At a fixed comm-CTA count the predictions never grow with bandwidth; the tool's own choice of
        # the count may move within its tie-break (the fewest CTAs within 0.2% of the fastest).
        for c in (1, 4, 8, 16, 32):
            fixed = replace(case, comm_ctas=c)
            times = [with_fabric(model, nvlink_gbps=nv, net_gbps=net).fused(fixed)["ms"] for nv, net in rates]
            assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), (case.shape.name, case.ranks, c, times)
        chosen = [with_fabric(model, nvlink_gbps=nv, net_gbps=net).fused(case)["ms"] for nv, net in rates]
        assert all(b <= a * 1.002 for a, b in zip(chosen, chosen[1:])), (case.shape.name, case.ranks, chosen)
        unfused = [with_fabric(model, nvlink_gbps=nv, net_gbps=net).unfused(case)["ms"] for nv, net in rates]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(unfused, unfused[1:])), (case.shape.name, case.ranks, unfused)


def test_fused_not_slower_when_communication_fits_under_the_gemms(calibrated):
    # Across ranks the unfused chain serializes its all-to-alls; when the fused layer's communication
    # fits under its GEMMs it is predicted no slower. (At one rank there is no all-to-all to hide, and
    # the fused layer was measured slightly slower on two shapes: docs/results.md.)
    model, _, _ = calibrated
    checked = 0
    for case in ep_cases(model, sizes=[p for p in sm.EP_SIZES if p > 1]):
        fused = model.fused(case)
        if fused["bound"] == "GEMM":
            checked += 1
            assert fused["ms"] <= model.unfused(case)["ms"], (case.shape.name, case.ranks)
    assert checked >= 10


def test_wave_model_gives_the_measured_layers_minibatch():
    measured = sm.Measured()
    for name, shape in measured.bench_shapes.items():
        cfg = shape["fused_config"]
        gemm_ctas = cfg["ctas_per_rank"] - cfg["comm_ctas"]
        assert sm.wave_minibatch_rows(gemm_ctas, shape["intermediate"]) == cfg["minibatch_rows"], name
        for group in shape["fused_sweeps"].get("virtual_ranks", {}).values():
            layer = group["layers"][0]
            ctas = layer["ctas_per_rank"] - layer["comm_ctas"]
            assert sm.wave_minibatch_rows(ctas, shape["intermediate"]) == layer["minibatch_rows"], name


def test_calibration_reproduces_every_point_within_the_stated_error(calibrated):
    model, _, rows = calibrated
    groups = sm.group_errors(rows)
    assert set(groups) == set(sm.STATED_ERROR)
    for row in rows:
        if row["role"] in (sm.OUTSIDE, "input"):
            assert row["note"], row["point"]  # every point the model does not claim says why
            continue
        assert abs(row["relative_error"]) <= sm.STATED_ERROR[row["group"]], row
    # The fitted constants stay physical.
    assert 0.2 < model.fit.comm_eff <= 1.0
    assert 0.8 < model.fit.gemm_peak < 1.2 and model.fit.gemm_r0 >= 0
    assert model.fit.overhead_fused_ms >= 0 and model.fit.overhead_unfused_ms >= 0


def test_inputs_are_read_from_the_results(tmp_path):
    # Double every row mover's measured rate: the per-CTA rate the model uses doubles with it.
    doc = json.loads(sm.RESULTS.read_text())
    for run in doc["copy"]["runs"]:
        run["gbps"] *= 2
    changed = tmp_path / "h200.json"
    changed.write_text(json.dumps(doc))
    before, after = sm.Measured(), sm.Measured(changed)
    assert after.cta_gbps(14336, 64) == pytest.approx(2 * before.cta_gbps(14336, 64))
    assert after.cta_gbps(8192, 36) == pytest.approx(2 * before.cta_gbps(8192, 36))


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert sm.main(["--json", str(out)]) == 0
    assert "Headline: deepseek_v3 EP shape at EP 8" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    head = doc["headline"]
    assert head["ep"] == 8 and head["fused"]["ms"] > 0 and head["unfused"]["ms"] > 0
    for phase in head["fused"]["timeline"] + head["unfused"]["timeline"]:
        assert 0 <= phase["start_ms"] <= phase["end_ms"] <= max(head["fused"]["ms"], head["unfused"]["ms"]) + 1e-9
    assert {p["ep"] for p in doc["predictions"]} == set(sm.EP_SIZES)
    assert set(doc["inputs_assumed"]) == {"nvlink_gbps", "net_gbps", "net_latency_us", "gpus_per_node"}
