"""Fixtures the guest tests of the shim share: the native build, and a local coordinator."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shimtest import NATIVE_DIR
from shimtest.coordinator import Coordinator


@pytest.fixture(scope="module")
def built() -> None:
    """Everything native/Makefile builds by default, once per module that asks."""
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR)], check=True)


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    with Coordinator(tmp_path / "coord.sock") as c:
        yield c
