"""The guest plugin reports in-guest passes, failures and skips faithfully on the host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.guest_selftest

HERE = Path(__file__).resolve().parent


def test_in_guest_outcomes_reach_host_report() -> None:
    cases = HERE / "selftest" / "guest_cases.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(cases)],
        cwd=HERE.parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout
    assert "1 failed, 1 passed, 1 skipped" in out, out
    assert "PASSED tests/testbed/selftest/guest_cases.py::test_runs_in_guest" in out
    assert "deliberate failure" in out
    assert "output from inside" in out
    assert "deliberate skip" in out
    assert run.returncode == 1
