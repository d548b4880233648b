#!/usr/bin/env python3
"""Summarise and draw an in-kernel timeline (the Chrome trace FusedMoe::stop_timeline returns and
`pounce_bench --timeline DIR` writes, from a build configured with -DPOUNCE_TIMELINE=ON).

Prints, for each kernel in the trace: its span from first to last event, and per kind of span (plan,
dispatch, tile wait, mainloop G1, epilogue G2, ...) how many there are, their total and mean length,
their share of the kernel's CTA-time (tracks x span) and the SMs' mean clock over them (cycles / time),
and the consumers' idle time between one tile's epilogue (or item) and the next tile's mainloop.
With --png, draws per kernel every track (one per CTA and warpgroup) over time, one colour per kind of
span, and under it the SMs' activity: how many tracks are in each kind of span at each moment, and the
mean clock of the spans running then. With --json, writes the summary.

Usage: tools/timeline.py TRACE.json [--png OUT.png] [--json OUT.json] [--title TEXT]
"""
import argparse
import collections
import json
import sys


def load(path):
    with open(path) as f:
        trace = json.load(f)
    kernels, spans = {}, collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            kernels[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            spans[e["pid"]].append(e)
    return {pid: (kernels.get(pid, f"kernel {pid}"), events) for pid, events in sorted(spans.items())}


def summarise(kernels):
    out = []
    for pid, (name, events) in kernels.items():
        begin = min(e["ts"] for e in events)
        end = max(e["ts"] + e["dur"] for e in events)
        tracks = {e["tid"] for e in events}
        kinds = collections.defaultdict(lambda: [0, 0.0, 0])
        for e in events:
            kinds[e["name"]][0] += 1
            kinds[e["name"]][1] += e["dur"]
            kinds[e["name"]][2] += e["args"].get("cycles", 0)
        gaps = tile_gaps(events)
        out.append({
            "kernel": name,
            "begin_us": begin,
            "span_us": end - begin,
            "tracks": len(tracks),
            "tile_gaps": {"count": len(gaps), "total_us": sum(gaps),
                          "mean_us": sum(gaps) / len(gaps) if gaps else 0.0},
            "kinds": {k: {"count": n, "total_us": total, "mean_us": total / n,
                          "share_of_track_time": total / (len(tracks) * (end - begin)) if end > begin else 0.0,
                          "mean_clock_mhz": cycles / total if total > 0 else 0.0}
                      for k, (n, total, cycles) in sorted(kinds.items())},
        })
    return out


def tile_gaps(events):
    """On each GEMM consumer track, the idle time from the end of one tile's work (its epilogue, or an
    elementwise item) to the start of the next (a mainloop or an item): the fixed cost per tile that
    neither span counts."""
    ends = ("epilogue", "elementwise")
    starts = ("mainloop", "elementwise")
    by_track = collections.defaultdict(list)
    for e in events:
        if e["name"].startswith(ends + starts):
            by_track[e["tid"]].append(e)
    gaps = []
    for spans in by_track.values():
        spans.sort(key=lambda e: e["ts"])
        for done, following in zip(spans, spans[1:]):
            if done["name"].startswith(ends) and following["name"].startswith(starts):
                gaps.append(max(0.0, following["ts"] - (done["ts"] + done["dur"])))
    return gaps


def activity(events, bins):
    """Per kind of span, the number of tracks in it in each of `bins` equal slices of the kernel's time
    (time-weighted), and the mean clock (MHz) of all spans in each slice; returns (edges, counts, clock)."""
    begin = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    width = (end - begin) / bins if end > begin else 1.0
    counts = collections.defaultdict(lambda: [0.0] * bins)
    busy, cycles = [0.0] * bins, [0.0] * bins
    for e in events:
        start, stop = e["ts"], e["ts"] + e["dur"]
        rate = e["args"].get("cycles", 0) / e["dur"] if e["dur"] > 0 else 0.0
        for b in range(int((start - begin) // width), min(bins, int((stop - begin) // width) + 1)):
            lo, hi = begin + b * width, begin + (b + 1) * width
            overlap = min(stop, hi) - max(start, lo)
            if overlap > 0:
                counts[e["name"]][b] += overlap / width
                busy[b] += overlap
                cycles[b] += overlap * rate
    edges = [begin + b * width for b in range(bins + 1)]
    clock = [cycles[b] / busy[b] if busy[b] > 0 else 0.0 for b in range(bins)]
    return edges, dict(counts), clock


def print_summary(summary):
    for k in summary:
        print(f"{k['kernel']}: {k['span_us']:.1f} us from {k['begin_us']:.1f}, {k['tracks']} tracks")
        g = k["tile_gaps"]
        if g["count"]:
            print(f"  gap between tiles {g['count']:6d} gaps   total {g['total_us']:12.1f} us  mean {g['mean_us']:9.2f} us")
        for kind, s in k["kinds"].items():
            print(f"  {kind:16s} {s['count']:8d} spans  total {s['total_us']:12.1f} us  "
                  f"mean {s['mean_us']:9.2f} us  {100 * s['share_of_track_time']:5.1f}% of track time  "
                  f"{s['mean_clock_mhz']:6.0f} MHz")


def draw(kernels, path, title, bins=200):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted({e["name"] for _, events in kernels.values() for e in events})
    cmap = plt.get_cmap("tab20")
    colour = {n: cmap(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(2 * len(kernels), 1, figsize=(14, 1 + 4.5 * len(kernels)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4] * len(kernels)})
    for i, (name, events) in enumerate(kernels.values()):
        tracks, profile = axes[2 * i, 0], axes[2 * i + 1, 0]
        rows = {tid: r for r, tid in enumerate(sorted({e["tid"] for e in events}))}
        bars = collections.defaultdict(lambda: collections.defaultdict(list))
        for e in events:
            bars[e["name"]][rows[e["tid"]]].append((e["ts"], max(e["dur"], 0.05)))
        for kind, by_row in bars.items():
            for row, spans in by_row.items():
                tracks.broken_barh(spans, (row, 0.9), facecolors=colour[kind], linewidth=0)
        tracks.set_ylim(0, len(rows))
        tracks.invert_yaxis()
        tracks.set_ylabel(f"{name}\n(CTA x warpgroup)")
        edges, counts, clock = activity(events, bins)
        kinds = sorted(counts)
        profile.stackplot(edges[:-1], [counts[k] for k in kinds], step="post", colors=[colour[k] for k in kinds])
        profile.set_ylabel("tracks in span")
        profile.set_xlim(tracks.get_xlim())
        mhz = profile.twinx()
        mhz.step(edges[:-1], clock, where="post", color="black", linewidth=0.8)
        mhz.set_ylabel("SM clock (MHz)")
    axes[-1, 0].set_xlabel("time (us)")
    fig.legend(handles=[Patch(color=colour[n], label=n) for n in names], loc="upper right", ncol=4, fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--png")
    p.add_argument("--json")
    p.add_argument("--title", default="")
    a = p.parse_args()
    kernels = load(a.trace)
    if not kernels:
        sys.exit(f"{a.trace}: no spans")
    summary = summarise(kernels)
    print_summary(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.png:
        draw(kernels, a.png, a.title or a.trace)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
