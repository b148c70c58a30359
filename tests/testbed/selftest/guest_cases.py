"""Cases for test_guest_plugin.py: not collected by default (the name has no test_ prefix)."""

import os

import pytest

pytestmark = pytest.mark.guest


def test_runs_in_guest() -> None:
    assert os.environ.get("IBCKPT_GUEST") == "1"
    assert os.path.exists("/dev/infiniband/uverbs0")


def test_fails_in_guest() -> None:
    print("output from inside")
    assert 1 + 1 == 3, "deliberate failure"


def test_skips_in_guest() -> None:
    pytest.skip("deliberate skip")
