#!/usr/bin/env python3
"""Gathers what scripts/gpu_check.sh left in OUTDIR into one JSON per GPU kind (results/<kind>.json) and
one log (results/<kind>.log): the benchmark JSONs as they are, the test and sanitizer summaries, the
command that produced them. Absolute paths are cut from the log so it reads the same on any machine.

usage: scripts/collect_results.py OUTDIR results/h200 --command "scripts/gpu_check.sh OUT --prebuilt --sanitize"
"""
import argparse
import json
import pathlib
import re

JSONS = ["bench-uniform", "bench-zipf", "bench-balanced", "torch", "copy", "dispatch", "ep"]
LOGS = ["pounce_tests_gpu", "pounce_experiment_tests", "pytest", "sanitizer", "bench", "bench-balanced", "bench-zipf", "copy", "dispatch",
        "ep", "torch"]


def scrub(text):
    # Source paths as the compiler saw them, and the output folder, without the machine's directories.
    text = re.sub(r"/[^\s:'\"]*/(src|experiments|include)/", r"\1/", text)
    text = re.sub(r"/[^\s:'\"]*/site-packages/", "<site-packages>/", text)  # Python warnings' sources
    return re.sub(r"/[^\s:'\"]*/(bench[-\w]*\.json|torch\.json|copy\.json|dispatch\.json|ep\.json)", r"<out>/\1", text)


def test_summary(log):
    summary = {}
    for key, pattern in [("passed", r"^\[  PASSED  \] (\d+) test"), ("failed", r"^\[  FAILED  \] (\d+) test"),
                         ("skipped", r"^\[  SKIPPED \] (\d+) test")]:
        m = re.search(pattern, log, re.M)
        summary[key] = int(m.group(1)) if m else 0
    summary["failures"] = re.findall(r"^\[  FAILED  \] ([A-Za-z]\S*)", log, re.M)
    return summary


def run_identity(outdir, doc):
    """GPU, commit and date: from the benchmark's JSON, else (a tests-only run) from build.log."""
    if "bench_uniform" in doc:
        env = doc["bench_uniform"]["environment"]
        return {"gpu": env["gpu"], "git_commit": env["git_commit"], "date": env["date"]}
    log = (outdir / "build.log").read_text()
    gpu = re.search(r"^\|\s+\d+\s+(NVIDIA [\w ]+?)\s{2,}", log, re.M)
    commit = re.search(r"^commit (\w+)", log, re.M)
    date = re.search(r"^(\w{3} \w{3} +\d+ [\d:]+ \d{4})", log, re.M)
    return {"gpu": gpu.group(1) if gpu else "unknown", "git_commit": commit.group(1) if commit else "unknown",
            "date": date.group(1) if date else "unknown"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=pathlib.Path)
    parser.add_argument("stem", type=pathlib.Path, help="results/<gpu kind>, without extension")
    parser.add_argument("--command", required=True, help="the command that filled OUTDIR")
    args = parser.parse_args()

    doc = {"command": args.command}
    for name in JSONS:
        path = args.outdir / f"{name}.json"
        if path.exists():
            doc[name.replace("-", "_")] = json.loads(path.read_text())
    doc = {**run_identity(args.outdir, doc), **doc}
    doc["tests"] = {}
    for suite in ["pounce_tests_gpu", "pounce_experiment_tests"]:
        path = args.outdir / f"{suite}.log"
        if path.exists():
            doc["tests"][suite] = test_summary(path.read_text())
    pytest_log = args.outdir / "pytest.log"
    if pytest_log.exists():
        lines = pytest_log.read_text().strip().splitlines()
        doc["tests"]["pytest"] = lines[-1] if lines else ""
    sanitizer = args.outdir / "sanitizer.log"
    if sanitizer.exists():
        text = sanitizer.read_text()
        doc["tests"]["sanitizers"] = {
            "runs": re.findall(r"^== compute-sanitizer --tool (\w+)", text, re.M),
            "summaries": re.findall(r"^========= (.*SUMMARY.*)$", text, re.M)}

    args.stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    with open(args.stem.with_suffix(".log"), "w") as log:
        log.write(f"# {args.command}\n# commit {doc['git_commit']}, {doc['gpu']}, {doc['date']}\n")
        for name in LOGS:
            path = args.outdir / f"{name}.log"
            if path.exists():
                log.write(f"\n## {name}.log\n\n" + scrub(path.read_text()))


if __name__ == "__main__":
    main()
