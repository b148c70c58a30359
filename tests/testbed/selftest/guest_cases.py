"""Cases for test_guest_plugin.py: not collected by default (the name has no test_ prefix)."""

import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.guest

# Made by the host's test: the first guest to see it says its kernel locked up, then hangs.
LOCKUP_ONCE = Path(__file__).with_name("lockup-once")


def test_runs_in_guest() -> None:
    assert os.environ.get("IBCKPT_GUEST") == "1"
    assert os.path.exists("/dev/infiniband/uverbs0")


def test_locks_up_once() -> None:
    if LOCKUP_ONCE.exists():
        LOCKUP_ONCE.unlink()
        Path("/dev/kmsg").write_text("<0>watchdog: BUG: soft lockup - CPU#0 stuck for 999s! [selftest:1]\n")
        time.sleep(600)


def test_fails_in_guest() -> None:
    print("output from inside")
    assert 1 + 1 == 3, "deliberate failure"


def test_skips_in_guest() -> None:
    pytest.skip("deliberate skip")
