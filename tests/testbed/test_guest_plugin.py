"""The guest plugin reports in-guest passes, failures and skips faithfully on the host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.guest_selftest

HERE = Path(__file__).resolve().parent


def test_in_guest_outcomes_reach_host_report_and_a_locked_up_guest_is_replaced() -> None:
    cases = HERE / "selftest" / "guest_cases.py"
    lockup_once = cases.with_name("lockup-once")
    lockup_once.touch()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", str(cases)],
            cwd=HERE.parents[1],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        lockup_once.unlink(missing_ok=True)
    out = run.stdout
    assert "1 failed, 2 passed, 1 skipped" in out, out
    assert "PASSED tests/testbed/selftest/guest_cases.py::test_runs_in_guest" in out
    # The first guest "locked up" in test_locks_up_once: killed at once, and a fresh guest ran that
    # test and the ones after it, while the first one's report of test_runs_in_guest was kept.
    assert not lockup_once.exists(), "the first guest never ran test_locks_up_once"
    locked = "locked up while tests/testbed/selftest/guest_cases.py::test_locks_up_once ran"
    assert f"in-guest run: a fresh guest ran the rest, as the guest's kernel {locked}" in out, out
    assert out.count("run in a fresh guest, as") == 2, out  # the two passes' sections: not test_runs_in_guest
    assert "deliberate failure" in out
    assert "output from inside" in out
    assert "deliberate skip" in out
    assert run.returncode == 1
