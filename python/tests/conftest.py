"""The tests run python/pounce of this checkout with the build tree's libpounce.so (build/bin), or with
$POUNCE_LIBRARY; with POUNCE_TEST_INSTALLED=1 they test the installed package instead."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if not os.environ.get("POUNCE_TEST_INSTALLED"):
    sys.path.insert(0, str(ROOT / "python"))
    built = ROOT / "build" / "bin" / "libpounce.so"
    if "POUNCE_LIBRARY" not in os.environ and built.exists():
        os.environ["POUNCE_LIBRARY"] = str(built)
