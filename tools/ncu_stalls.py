#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from an Nsight Compute report with source
counters (`ncu --section SourceCounters ...`), or from that report's source page saved as CSV
(`ncu --import REPORT --page source --csv --print-source sass > FILE.csv`, to read it where ncu is not
installed): prints the instructions with the most stall samples, each with its share of all
samples, its SASS text and its largest stall reasons, plus the share of samples in the address ranges
named by --span (e.g. the epilogue's first and last instruction, to total a whole phase).

usage: tools/ncu_stalls.py REPORT.ncu-rep|SOURCE.csv [--top 40] [--kernel N] [--span NAME:FIRST_ADDR:LAST_ADDR ...]
"""
import argparse
import csv
import io
import subprocess


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def source_rows(report, kernel):
    if report.endswith(".csv"):
        with open(report) as f:
            page = f.read()
    else:
        page = subprocess.run(["ncu", "--import", report, "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, check=True).stdout
    # One table per profiled kernel, each starting with its own header line.
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
    tables = [t for t in tables if t and t[0].startswith('"Address"')]
    return list(csv.DictReader(io.StringIO("\n".join(tables[kernel])))), len(tables)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--kernel", type=int, default=0, help="which profiled kernel of the report")
    parser.add_argument("--span", action="append", default=[], help="NAME:FIRST_ADDR:LAST_ADDR (hex)")
    args = parser.parse_args()

    rows, kernels = source_rows(args.report, args.kernel)
    sample_key = next(k for k in rows[0] if k.startswith("Warp Stall Sampling (All"))
    reason_keys = [k for k in rows[0] if k.startswith("stall_") or "Stall" in k and k != sample_key
                   and "Not-issued" not in k]
    total = sum(number(r[sample_key]) for r in rows) or 1.0
    print(f"kernel {args.kernel} of {kernels}: {len(rows)} instructions, {total:.0f} stall samples")
    print("columns:", ", ".join(rows[0].keys()))
    for span in args.span:
        name, first, last = span.split(":")
        lo, hi = int(first, 16), int(last, 16)
        inside = sum(number(r[sample_key]) for r in rows if lo <= int(r["Address"], 16) <= hi)
        print(f"span {name} [{first}, {last}]: {100 * inside / total:.1f}% of samples")
    ranked = sorted(rows, key=lambda r: -number(r[sample_key]))[:args.top]
    for r in ranked:
        reasons = sorted(((number(r[k]), k) for k in reason_keys if number(r[k]) > 0), reverse=True)[:3]
        why = ", ".join(f"{k.replace('stall_', '')} {100 * v / total:.1f}%" for v, k in reasons)
        print(f"{r['Address']:>8} {100 * number(r[sample_key]) / total:5.1f}%  {r['Source'][:60]:<60} {why}")


if __name__ == "__main__":
    main()
