"""ibckpt_native: Python side of libibckpt (control client, local coordinator, cffi core)."""

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
