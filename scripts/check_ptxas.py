#!/usr/bin/env python3
"""What ptxas says about the library's kernels only when asked (-v), checked on every build:

- no "Potential Performance Loss" note of ptxas anywhere: above all the wgmma ones (C7509-C7520: every
  wgmma of the kernel then waits for the one before it, which costs a GEMM a large share of its speed
  without any error or warning; it happens, for example, when wgmmas of two shapes share accumulator
  registers, or when the accumulators do not fit the registers), and setmaxnreg ignored;
- no warpgroup.arrive that ptxas injected (C7519, printed as plain info): it comes with a dummy wgmma
  where a commit group is closed after branches that issued wgmmas, and then each wait for the previous
  group waits for the group just issued (a loop choosing between two wgmma layouts per slice lost
  7-14 % of its cycles that way);
- the grouped GEMM's kernels (src/gemm/grouped_gemm.cu) may not spill registers.

Recompiles the library's CUDA sources with the build's own nvcc commands (`ninja -t commands`) plus
-Xptxas -v, into a temporary folder (the build tree is not touched), and prints each kernel's registers
and spills.

usage: scripts/check_ptxas.py BUILD_DIR [--jobs N]
"""
import argparse
import concurrent.futures
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

NO_SPILLS = ("src/gemm/grouped_gemm.cu",)
LOSS = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?)(?: in the function '([^']+)')?\s*$")
INJECTED = re.compile(r"\((C\d+)\) (warpgroup\.\w+ is injected .*?)(?: in function '([^']+)')?\s*$")
PROPERTIES = re.compile(r"Function properties for (\S+)")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Compiling entry function '([^']+)'|Used (\d+) registers")


def library_cuda_commands(build):
    """(source, argv) of every nvcc command that compiles a .cu file of the library target."""
    text = subprocess.run(["ninja", "-C", build, "-t", "commands", "pounce"], check=True, capture_output=True,
                          text=True).stdout
    commands = []
    for line in text.splitlines():
        argv = shlex.split(line)
        if not argv or not argv[0].endswith("nvcc") or "-c" not in argv:
            continue
        source = argv[argv.index("-c") + 1]
        if source.endswith(".cu") and any("CMakeFiles/pounce.dir" in a for a in argv):
            commands.append((source, argv))
    return commands


def without_outputs(argv, obj):
    """argv writing its object to `obj` and no dependency file."""
    out, skip = [], 0
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if a in ("-MT", "-MF", "-o"):
            skip = 1
            continue
        if a == "-MD":
            continue
        out.append(a)
    return out + ["-o", obj, "-Xptxas", "-v"]


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    shown = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, shown)) if len(shown) == len(names) else {n: n for n in names}


def parse(log):
    """({kernel: {registers, stack, spill_stores, spill_loads}}, [(note, what, kernel or None)] of the
    performance-loss notes and injected warpgroup instructions) from ptxas -v output (kernels by mangled
    name)."""
    kernels, losses, current = {}, [], None
    for line in log.splitlines():
        if m := LOSS.search(line) or INJECTED.search(line):
            losses.append(m.groups())
        if m := PROPERTIES.search(line):
            current = m.group(1)
            kernels.setdefault(current, {})
        elif current and (m := SPILLS.search(line)):
            kernels[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        if m := REGISTERS.search(line):
            if m.group(1):
                current = m.group(1)
                kernels.setdefault(current, {})
            elif current:
                kernels[current]["registers"] = int(m.group(2))
    return kernels, losses


def check(build, source, argv, folder, index):
    """(report lines, problems) of one source."""
    run = subprocess.run(without_outputs(argv, f"{folder}/{index}.o"), cwd=build, capture_output=True, text=True)
    if run.returncode != 0:
        return [run.stdout + run.stderr], [f"{source}: nvcc failed"]
    kernels, losses = parse(run.stdout + run.stderr)
    names = demangle(sorted(set(kernels) | {kernel for _, _, kernel in losses if kernel}))
    problems = [f"{source}: ptxas {note} in {names[kernel] if kernel else 'a kernel'}: {what}"
                for note, what, kernel in losses]
    if not kernels:
        problems.append(f"{source}: no kernel in ptxas's report (was -Xptxas -v honoured?)")
    report = [f"{source}:"]
    for name in sorted(kernels):
        k = kernels[name]
        report.append(f"  {k.get('registers', '?'):>4} registers, {k.get('spill_stores', 0):>4} / "
                      f"{k.get('spill_loads', 0):>4} bytes spilled / reloaded  {names[name][:120]}")
        if k.get("spill_stores", 0) + k.get("spill_loads", 0) and source.endswith(NO_SPILLS):
            problems.append(f"{source}: {names[name]} spills {k['spill_stores']} bytes")
    return report, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    commands = library_cuda_commands(args.build)
    if not commands:
        sys.exit(f"check_ptxas: no nvcc command of the library in {args.build} (configure and build it first)")
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: check(args.build, c[1][0], c[1][1], folder, c[0]), enumerate(commands)))
    compiled = [source for source, _ in commands]
    problems = [f"{path}: not among the library's sources" for path in NO_SPILLS
                if not any(source.endswith(path) for source in compiled)]
    for report, found in results:
        print("\n".join(report))
        problems += found
    if problems:
        print("\ncheck_ptxas: " + "\n  ".join(["FAILED"] + problems))
        sys.exit(1)
    print(f"\ncheck_ptxas: {len(commands)} sources, no performance-loss note, no spill in {', '.join(NO_SPILLS)}")


if __name__ == "__main__":
    main()
