"""Two Soft-RoCE guests ("node A" and "node B") joined by a private link: verbs traffic across."""

from __future__ import annotations

import re

import pytest

from testbed.guest import GuestSpec, run_pair

pytestmark = pytest.mark.twoguests


def test_rc_pingpong_across_two_guests() -> None:
    server = "ibv_rc_pingpong -d rxe0 -g 1 -n 100"
    client = "sleep 2; ibv_rc_pingpong -d rxe0 -g 1 -n 100 10.77.0.1"
    node_a, node_b = run_pair(GuestSpec(server), GuestSpec(client), timeout=300)
    assert node_a.returncode == 0, node_a.output[-3000:]
    assert node_b.returncode == 0, node_b.output[-3000:]
    # Each side saw the other's GID: the traffic really crossed the link.
    assert re.search(r"remote address: .*GID ::ffff:10\.77\.0\.2", node_a.output), node_a.output
    assert re.search(r"remote address: .*GID ::ffff:10\.77\.0\.1", node_b.output), node_b.output
    assert "100 iters in" in node_a.output and "100 iters in" in node_b.output
