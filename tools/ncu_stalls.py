#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from an Nsight Compute report with source
counters (`ncu --section SourceCounters ...`), or from that report's source page saved as CSV
(`ncu --import REPORT --page source --csv --print-source sass > FILE.csv`, to read it where ncu is not
installed): prints the instructions with the most stall samples, each with its offset in the kernel, its
share of all samples, its SASS text and its largest stall reasons, and the share of samples in the
offset ranges named by --span (e.g. the epilogue's first and last instruction, to total a whole phase).

usage: tools/ncu_stalls.py REPORT.ncu-rep|SOURCE.csv [--top 40] [--kernel N] [--span NAME:FIRST:LAST ...]
  (FIRST and LAST: hexadecimal offsets from the kernel's first instruction, as the listing prints them)
"""
import argparse
import csv
import io
import subprocess

SAMPLES = "Warp Stall Sampling (All Samples)"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernel_tables(page):
    """The source page's tables, one per profiled kernel: lists of rows (dicts by column name)."""
    tables, current = [], []
    for line in page.splitlines():
        if line.startswith('"Kernel Name"'):
            continue
        if line.startswith('"Address"') and current:
            tables.append(current)
            current = []
        current.append(line)
    if current:
        tables.append(current)
    return [list(csv.DictReader(io.StringIO("\n".join(t)))) for t in tables if t[0].startswith('"Address"')]


def report(rows, top, spans):
    """Lines of the summary of one kernel's rows; spans: (name, first offset, last offset)."""
    base = int(rows[0]["Address"], 16)
    reason_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    lines = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    for name, first, last in spans:
        inside = sum(number(r[SAMPLES]) for r in rows if first <= int(r["Address"], 16) - base <= last)
        lines.append(f"span {name} [{first:x}, {last:x}]: {100 * inside / total:.1f}% of samples")
    for r in sorted(rows, key=lambda r: -number(r[SAMPLES]))[:top]:
        reasons = sorted(((number(r[k]), k) for k in reason_keys if number(r[k]) > 0), reverse=True)[:3]
        why = ", ".join(f"{k.removeprefix('stall_')} {100 * v / total:.1f}%" for v, k in reasons)
        offset = int(r["Address"], 16) - base
        lines.append(f"{offset:6x} {100 * number(r[SAMPLES]) / total:5.1f}%  {r['Source'].strip()[:60]:<60} {why}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--kernel", type=int, default=0, help="which profiled kernel of the report")
    parser.add_argument("--span", action="append", default=[], help="NAME:FIRST:LAST (hexadecimal offsets)")
    args = parser.parse_args()
    if args.report.endswith(".csv"):
        with open(args.report) as f:
            page = f.read()
    else:
        page = subprocess.run(["ncu", "--import", args.report, "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, check=True).stdout
    tables = kernel_tables(page)
    spans = [(name, int(first, 16), int(last, 16)) for name, first, last in (s.split(":") for s in args.span)]
    print(f"kernel {args.kernel} of {len(tables)}: " + "\n".join(report(tables[args.kernel], args.top, spans)))


if __name__ == "__main__":
    main()
