"""The shim's futex lock and the flag that closes a QP's posts, stressed on the host.

The post fast paths take no gate: quiesce sets IBK_LOCK_SLOW on every post lock and
waits until none is held. native/tests/lock_stress.c runs trylock "posters", ibk_lock
"internal" threads and a closer side by side; it fails if an increment is lost, a
poster gets in while the posts are closed, or the flag is lost. The TSan build also
checks the memory ordering."""

from __future__ import annotations

import json
import subprocess

import pytest

from shimtest import NATIVE_DIR


@pytest.mark.parametrize("variant", ["lock_stress", "lock_stress-tsan"])
def test_lock_keeps_posts_closed_and_excludes(variant: str) -> None:
    target = f"build/tests/{variant}"
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), target], check=True)
    run = subprocess.run(
        [str(NATIVE_DIR / target), "2"], capture_output=True, text=True, timeout=120, check=False
    )
    assert "ThreadSanitizer" not in run.stderr, run.stderr
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["counter"] == report["ops"] > 10_000
    assert report["closes"] > 10
    assert report["poster_inside_closed"] == 0
    assert report["word"] == 0
