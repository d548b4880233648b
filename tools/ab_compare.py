#!/usr/bin/env python3
"""Two builds measured against each other: reads the pounce_bench JSONs that scripts/ab_bench.sh wrote
(A-1.json, B-1.json, A-2.json, ... in one folder), takes every timed row of every shape (its `what` and
`impl`, its median), and prints for each row the median over the rounds of A and of B, and B's speed
relative to A (A's ms / B's ms: above 1, B is faster), with each build's spread over the rounds.

usage: tools/ab_compare.py OUTDIR [--match TEXT ...]   (only rows whose shape, what or impl contain a TEXT)
"""
import argparse
import json
import pathlib
import statistics


def timed_rows(node, found=None):
    """Every dict under `node` with `what`, `impl` and `timing`: (what, impl) -> median ms."""
    found = {} if found is None else found
    if isinstance(node, dict):
        if {"what", "impl", "timing"} <= node.keys():
            found[(node["what"], node["impl"])] = node["timing"]["median_ms"]
        for value in node.values():
            timed_rows(value, found)
    elif isinstance(node, list):
        for value in node:
            timed_rows(value, found)
    return found


def rows_of(document):
    """(shape, what, impl) -> median ms of one benchmark JSON."""
    rows = {}
    for shape in document["shapes"]:
        for (what, impl), ms in timed_rows(shape).items():
            rows[(shape["shape"], what, impl)] = ms
    return rows


def rounds(folder, build):
    paths = sorted(folder.glob(f"{build}-*.json"), key=lambda p: int(p.stem.split("-")[-1]))
    return [rows_of(json.loads(p.read_text())) for p in paths]


def compare(a_rounds, b_rounds, match=()):
    """Lines of the comparison: rows present in every round of both builds, in the first round's order."""
    keys = [k for k in a_rounds[0] if all(k in r for r in a_rounds + b_rounds)]
    if match:
        keys = [k for k in keys if any(m in " ".join(k) for m in match)]
    lines = [f"{'shape':18} {'what':30} {'impl':44} {'A ms':>8} {'B ms':>8} {'B speed':>8} {'A spread':>9} "
             f"{'B spread':>9}"]
    for key in keys:
        a = [r[key] for r in a_rounds]
        b = [r[key] for r in b_rounds]
        a_ms, b_ms = statistics.median(a), statistics.median(b)
        spread = lambda v, m: f"{100 * (max(v) - min(v)) / m:.1f}%" if m > 0 else "-"
        lines.append(f"{key[0][:18]:18} {key[1][:30]:30} {key[2][:44]:44} {a_ms:8.3f} {b_ms:8.3f} "
                     f"{(a_ms / b_ms if b_ms > 0 else float('nan')):7.3f}x {spread(a, a_ms):>9} {spread(b, b_ms):>9}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=pathlib.Path)
    parser.add_argument("--match", nargs="*", default=[])
    args = parser.parse_args()
    a, b = rounds(args.outdir, "A"), rounds(args.outdir, "B")
    if not a or not b:
        raise SystemExit(f"{args.outdir}: needs A-<round>.json and B-<round>.json files")
    print(f"{len(a)} rounds of A, {len(b)} of B")
    print("\n".join(compare(a, b, args.match)))


if __name__ == "__main__":
    main()
