"""What the PyTorch benchmark scripts share: NVLink multicast off before anything creates a communicator
(it can take shared machines down); the pounce package of this checkout (python/) over the library
POUNCE_LIBRARY names or this checkout's build/bin/libpounce.so, else an installed one, else None; and
interleaved CUDA-event timing. Import it before torch."""

import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROOT = Path(__file__).resolve().parent.parent

try:
    if (ROOT / "build" / "bin" / "libpounce.so").exists():
        os.environ.setdefault("POUNCE_LIBRARY", str(ROOT / "build" / "bin" / "libpounce.so"))
    if "POUNCE_LIBRARY" in os.environ:  # a build of this checkout: its package, not an installed one
        sys.path.insert(0, str(ROOT / "python"))
    import pounce
except ImportError:
    pounce = None

import torch  # noqa: E402  (after the environment above)


def summarize(times):
    """Median, minimum and 90th percentile of repetition times (ms)."""
    times = sorted(times)
    p90 = times[int(0.9 * (len(times) - 1) + 0.5)]
    return {"median_ms": statistics.median(times), "min_ms": times[0], "p90_ms": p90, "reps": len(times)}


def interleaved_times(fns, warmup, reps):
    """Milliseconds of every function in every repetition, [rep][fn], the functions taking turns within a
    repetition so that clock drift hits all alike (CUDA events on the current stream)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns] for _ in range(reps)
    ]
    for row in events:
        for fn, (start, stop) in zip(fns, row):
            start.record()
            fn()
            stop.record()
    torch.cuda.synchronize()
    return [[start.elapsed_time(stop) for start, stop in row] for row in events]
