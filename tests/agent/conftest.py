"""Fixtures shared by the node agent's host tests: a running agent and a process to register."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent.agent_harness import Running


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Running]:
    """The agent, its state (registry socket, sessions) in tmp_path/state."""
    running = Running(tmp_path / "state")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process to register as a container's."""
    proc = subprocess.Popen(["/bin/sleep", "300"])  # by path: some tests change PATH
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH whose criu 'dumps' by exiting 0: the session gets past the dump without a real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    criu = bin_dir / "criu"
    criu.write_text("#!/bin/sh\nexit 0\n")
    criu.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
