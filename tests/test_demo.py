"""The README's first command must keep working: `make demo` checkpoints a two-node verbs job to S3
and restores it swapped, with exactly-once delivery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.twoguests

TESTS = Path(__file__).resolve().parent


def test_demo_moves_the_job_through_s3_exactly_once() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "testbed.demo"],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "COLUMNS": "120"},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "committed in S3: 2 ranks" in out
    assert "every message delivered exactly once" in out
    assert "Total" in out and "OK" in out
