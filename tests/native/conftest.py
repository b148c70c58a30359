"""Fixtures the tests of the shim share: the native build, a local coordinator (guest tests), and
the pure core loaded through cffi (host unit tests)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shimtest import CORE, NATIVE_DIR
from shimtest.coordinator import Coordinator
from shimtest.core import load


@pytest.fixture(scope="module")
def built() -> None:
    """Everything native/Makefile builds by default, once per module that asks."""
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR)], check=True)


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    with Coordinator(tmp_path / "coord.sock") as c:
        yield c


@pytest.fixture(scope="module")
def lib() -> Any:
    """libibckpt_core.so, built if need be, loaded through cffi: the pure core, no libibverbs."""
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt_core.so"], check=True)
    assert CORE.exists()
    return load()
