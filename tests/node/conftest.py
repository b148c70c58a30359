"""Fixtures shared by the node agent's host tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from node.named_threads import process_with_named_thread


@pytest.fixture
def named_sleeper() -> Iterator[tuple[int, int]]:
    """A process shaped like a rank under the shim: (pid, tid of its thread named ibk-control)."""
    with process_with_named_thread("ibk-control") as ids:
        yield ids


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A real process with no device fds, standing in for every rank's pid."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()
