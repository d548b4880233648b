"""What the PyTorch benchmark scripts share: NVLink multicast off before anything creates a communicator
(it can take shared machines down), and the pounce package of this checkout (python/) over the library
POUNCE_LIBRARY names or this checkout's build/bin/libpounce.so, else an installed one, else None. Import
it before torch."""

import os
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
