"""tools/timeline.py on the CPU, on a small trace in the format FusedMoe::stop_timeline writes: the
summary's counts, totals and clocks, the activity profile, and the PNG."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("timeline_tool", ROOT / "tools" / "timeline.py")
tl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tl)


def span(name, pid, tid, ts, dur, cycles):
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {"sm": tid // 4, "a": 0, "b": 0, "c": 0, "cycles": cycles}}


@pytest.fixture
def trace(tmp_path):
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "fused forward"}},
        span("mainloop G1", 0, 1, 0.0, 10.0, 15000),  # 1500 MHz
        span("mainloop G1", 0, 2, 0.0, 10.0, 13000),  # 1300 MHz
        span("epilogue G1", 0, 1, 10.0, 2.0, 3000),
        span("mainloop G1", 3, 5, 100.0, 4.0, 4000),  # a process without a name
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    return path


def test_summary_counts_times_and_clocks(trace):
    kernels = tl.load(trace)
    assert [name for name, _ in kernels.values()] == ["fused forward", "kernel 3"]
    fused, other = tl.summarise(kernels)
    assert fused["span_us"] == pytest.approx(12.0) and fused["tracks"] == 2
    main = fused["kinds"]["mainloop G1"]
    assert main["count"] == 2 and main["total_us"] == pytest.approx(20.0)
    assert main["mean_clock_mhz"] == pytest.approx(1400.0)  # cycles over time, not a mean of rates
    assert main["share_of_track_time"] == pytest.approx(20.0 / 24.0)
    assert fused["kinds"]["epilogue G1"]["mean_clock_mhz"] == pytest.approx(1500.0)
    assert other["kinds"]["mainloop G1"]["mean_clock_mhz"] == pytest.approx(1000.0)


def test_tile_gaps_count_idle_time_between_tiles_per_track():
    events = [
        span("mainloop G1", 0, 1, 0.0, 10.0, 0),
        span("epilogue G1", 0, 1, 10.0, 2.0, 0),
        span("elementwise", 0, 1, 13.5, 4.0, 0),   # 1.5 after the epilogue
        span("mainloop G2", 0, 1, 18.0, 3.0, 0),   # 0.5 after the item
        span("epilogue G2", 0, 1, 21.0, 1.0, 0),
        span("tile wait G1", 0, 0, 0.0, 30.0, 0),  # the producer's track: not a consumer's gap
        span("mainloop G1", 0, 2, 5.0, 1.0, 0),    # another track: its first tile has no gap before it
        span("epilogue G1", 0, 2, 6.0, 1.0, 0),
        span("mainloop G1", 0, 2, 9.0, 1.0, 0),    # 2.0
    ]
    assert sorted(tl.tile_gaps(events)) == pytest.approx([0.5, 1.5, 2.0])


def test_summary_reports_tile_gaps(trace):
    fused, other = tl.summarise(tl.load(trace))
    assert fused["tile_gaps"]["count"] == 0 and other["tile_gaps"]["count"] == 0  # no tile follows an epilogue


def test_activity_profile(trace):
    _, events = tl.load(trace)[0]
    edges, counts, clock = tl.activity(events, bins=6)  # 2 us a bin over 12 us
    assert edges[0] == pytest.approx(0.0) and edges[-1] == pytest.approx(12.0)
    assert counts["mainloop G1"] == pytest.approx([2, 2, 2, 2, 2, 0])
    assert counts["epilogue G1"] == pytest.approx([0, 0, 0, 0, 0, 1])
    assert clock[0] == pytest.approx(1400.0) and clock[-1] == pytest.approx(1500.0)


def test_png(trace, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "trace.png"
    tl.draw(tl.load(trace), out, "test")
    assert out.stat().st_size > 0
