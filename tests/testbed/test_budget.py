"""The session's time budget leaves a long story out only when it would not fit, and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testbed.budget import BUDGET_ENV, left_out

TESTS = Path(__file__).resolve().parents[1]

STORIES = """
import time
import pytest

def test_first():
    time.sleep(2)

@pytest.mark.budget(minutes=0.5)
def test_fits():
    pass

@pytest.mark.budget(minutes=1)
def test_too_long():
    raise AssertionError("must not run")

def test_unmarked_always_runs():
    pass
"""


def test_a_story_starts_only_if_it_fits() -> None:
    assert left_out(0, 10, 75) is None
    assert left_out(65 * 60, 10, 75) is None
    why = left_out(66 * 60, 10, 75)
    assert why is not None and "66 min of the session's 75 used" in why and "may take 10 more" in why


def test_a_session_skips_what_no_longer_fits_and_runs_the_rest(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["testbed.budget"]\n')
    (tmp_path / "test_stories.py").write_text(STORIES)
    env = dict(os.environ, PYTHONPATH=str(TESTS), **{BUDGET_ENV: "0.75"})  # 45 s
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (its --basetemp) are not the inner one's
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = ran.stdout
    assert ran.returncode == 0, out + ran.stderr
    assert "test_first PASSED" in out and "test_fits PASSED" in out, out
    assert "test_too_long SKIPPED" in out and "test_unmarked_always_runs PASSED" in out, out
    assert "CI time budget: 0 min of the session's 1 used, and this story may take 1 more" in out, out
