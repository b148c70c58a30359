"""shimtest: the test and bench side of libibckpt, kept out of the product's package.

Where the build puts the shim and the C test programs, the harness that runs programs under
the shim (harness.py), the local coordinator (coordinator.py) and the cffi binding of the pure
core (core.py). Importable from tests and bench (pytest's pythonpath has native/).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent.parent
BUILD_DIR = NATIVE_DIR / "build"
SHIM = BUILD_DIR / "libibckpt.so"
SHIM_ASAN = BUILD_DIR / "libibckpt-asan.so"
SHIM_UBSAN = BUILD_DIR / "libibckpt-ubsan.so"
CORE = BUILD_DIR / "libibckpt_core.so"
TESTS_DIR = BUILD_DIR / "tests"

__all__ = ["BUILD_DIR", "CORE", "NATIVE_DIR", "SHIM", "SHIM_ASAN", "SHIM_UBSAN", "TESTS_DIR"]
