"""bench/orchestration.py at its smallest size (16 ranks, 2 agents) runs through and prints its table.

Speed is the bench's to report, not this test's: nothing here looks at a number.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "orchestration.py"


def test_the_orchestration_bench_runs_the_cut_and_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "16 ranks / 2 agents" in out, out
    # a row per barrier of the fast cut, then the cut and the ratio to the goal
    for barrier in ("Joined", "Admitted", "Drained", "Released"):
        assert f"transition '{barrier}'" in out, out
    assert "mean transition" in out, out
    assert "orchestration: cut less shims" in out, out
    assert "slowest transition at 16 ranks / goal 10.0 ms:" in out, out
