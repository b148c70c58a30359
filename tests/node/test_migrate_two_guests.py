"""A two-rank verbs job moves across nodes: checkpoint on A and B, restore each rank on the OTHER node.

Rank 0 (rc_seq server) starts on node A and rank 1 (rc_seq client) on node B, exchanging
sequence-numbered, checksummed messages both ways over RC. Mid-traffic, each node's agent
runs a Stop checkpoint through the job coordinator on the host (quiesce, drain, release,
CRIU dump into a shared dir) and both guests power off. Two fresh guests then boot with the
roles swapped: rank 0 is restored on node B and rank 1 on node A, so every GID and QPN is
new; they rebuild through the coordinator, resume, and must finish with every message
delivered exactly once and matching checksums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from node.rc_pair import migrate_swapped

pytestmark = pytest.mark.twoguests


def test_two_ranks_checkpointed_and_restored_on_the_other_nodes(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Each restored rank answers `status` in epoch 2 and has posted through the device thread.
    migrate_swapped(coordinator, tmp_path)
