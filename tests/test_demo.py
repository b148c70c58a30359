"""The README's first command must keep working: `make demo` installs the chart on the local two-node
cluster, checkpoints a two-pod verbs job with a CheckpointJob and restores it swapped with a RestoreJob,
with exactly-once delivery. It boots its own cluster, so it runs before the cluster tests (not marked
`cluster`: their session cluster starts after it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the demo boots its own cluster and builds the images first: pytest's default 900 s is not its bound
pytestmark = [pytest.mark.twoguests, pytest.mark.timeout(2400)]

TESTS = Path(__file__).resolve().parent


def test_demo_moves_the_job_through_s3_exactly_once() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "testbed.demo"],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=2400,
        env={**os.environ, "COLUMNS": "120"},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "committed in S3: 2 pods" in out
    assert "checkpointjob move: Succeeded" in out and "restorejob back: Succeeded" in out
    assert "'ring-0': 'node-2', 'ring-1': 'node-1'" in out  # restored on the other nodes
    assert "every message delivered exactly once" in out
    assert "Total" in out and "OK" in out
