#!/usr/bin/env python3
"""Instruction counts of a kernel's wgmma loops, from its SASS: for each loop (a backward branch) whose body
holds wgmma instructions (QGMMA, HGMMA), its size and the length of its fast path, the instructions a warp
executes per iteration when no wait stalls (a bounded wait's polling and reporting code, entered only when
the first try_wait fails, is skipped). This is the count behind "instructions per K slice": the FP8
mainloop's consumers are bound by their own issue, so the fast path's length tracks their speed.

usage: tools/sass_loops.py OBJECT_OR_LIBRARY --kernel REGEX [--cuobjdump PATH] [--list]
  e.g. tools/sass_loops.py build/CMakeFiles/pounce.dir/src/gemm/grouped_gemm.cu.o --kernel 'TileKindE1E'
  (kernels are matched by mangled name: TileKindE1E is the E4M3 forward kind; --list prints each fast
  path's instructions other than FFMA)
"""
import argparse
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
BRANCH = re.compile(r"BRA (0x[0-9a-f]+)")


def kernels(sass):
    """{mangled name: [(offset, text)]} from cuobjdump -sass output."""
    found, name = {}, None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            found[name] = []
        elif name is not None:
            m = INSTRUCTION.match(line)
            if m:
                found[name].append((int(m.group(1), 16), m.group(2)))
    return found


def fast_path(body, at):
    """The instructions of a loop body in execution order when every try_wait succeeds at once: after a
    try_wait, the branch that follows it (taken on success) jumps over the polling code."""
    path, i = [], 0
    while i < len(body):
        offset, text = body[i]
        path.append(text)
        if "TRYWAIT" in text:
            for j in range(i + 1, min(i + 4, len(body))):
                m = re.search(r"@P\d+ " + BRANCH.pattern, body[j][1])
                if m and int(m.group(1), 16) in at:
                    path.extend(t for _, t in body[i + 1 : j + 1])
                    i = at[int(m.group(1), 16)]
                    break
            else:
                i += 1
            continue
        i += 1
    return path


def loops(code):
    """The innermost loops holding wgmma instructions (no other such loop inside): (first, last, body)."""
    at = {offset: i for i, (offset, _) in enumerate(code)}
    found = []
    for i, (offset, text) in enumerate(code):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < offset and int(m.group(1), 16) in at:
            body = code[at[int(m.group(1), 16)] : i + 1]
            if any("GMMA" in t for _, t in body):
                found.append((body[0][0], offset, body))
    found.sort(key=lambda loop: len(loop[2]))
    innermost = []
    for first, last, body in found:
        if not any(first <= f and l <= last for f, l, _ in innermost):
            innermost.append((first, last, body))
    return innermost


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary")
    parser.add_argument("--kernel", required=True, help="regular expression on the mangled kernel name")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    parser.add_argument("--list", action="store_true", help="print each fast path's non-FFMA instructions")
    args = parser.parse_args()
    sass = subprocess.run([args.cuobjdump, "-sass", args.binary], check=True, capture_output=True, text=True).stdout
    matched = {name: code for name, code in kernels(sass).items() if re.search(args.kernel, name)}
    if not matched:
        sys.exit(f"no kernel matches {args.kernel!r}")
    for name, code in matched.items():
        print(name)
        for first, last, body in loops(code):
            path = fast_path(body, {offset: i for i, (offset, _) in enumerate(body)})
            mma = sum("GMMA" in t for t in path)
            ffma = sum(t.startswith("FFMA") for t in path)
            print(f"  loop {first:#x}-{last:#x}: {len(body)} instructions, fast path {len(path)} "
                  f"({mma} wgmma, {ffma} FFMA, {len(path) - mma - ffma} other)")
            if args.list:
                for text in path:
                    if not text.startswith("FFMA"):
                        print("      " + text)


if __name__ == "__main__":
    main()
