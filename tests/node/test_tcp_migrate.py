"""TCP between ranks survives the move: an established connection beside the QPs follows both ranks.

The two rc_seq ranks keep their bootstrap TCP connection open (`-t 50`) and send a
sequence-numbered, checked ping over it every 50 messages, beside the RC traffic. They are
Stop-checkpointed on nodes A (10.77.0.1) and B (10.77.0.2); CRIU dumps the connection with TCP
repair. Fresh guests boot and each rank is restored on the OTHER node, with the agents'
`--remap-ip` swapping the two addresses in the images: rank 0's socket, once 10.77.0.1:18515 ->
10.77.0.2:eph, becomes 10.77.0.2:18515 -> 10.77.0.1:eph, and rank 1's the mirror image. Both the
RDMA traffic (exactly-once, checksums) and the TCP pings (every one in order, then each side's
END carrying its count, sent after the move) must continue to the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from node.rc_pair import KEYS, SWAP, migrate_swapped

pytestmark = pytest.mark.twoguests

TCP_RE = re.compile(r"TCP sent=(\d+) received=(\d+) bad=(\d+)")


def test_tcp_connection_between_ranks_follows_a_swapped_restore(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    migrate_swapped(coordinator, work, rc_args="-t 50", restore_args=SWAP)

    # Preflight let the connection through: its peer is the other node of the job.
    for node in (1, 2):
        report = json.loads((work / f"ckpt-node-{node}.json").read_text())
        assert report["outcome"] == "Stopped" and "Admitted" in report["phases"], report
    # The images held the connection, and each restore rewrote both of its addresses.
    for node, key, moved in ((2, KEYS[0], "10.77.0.1 -> 10.77.0.2"), (1, KEYS[1], "10.77.0.2 -> 10.77.0.1")):
        report = json.loads((work / f"restore-node-{node}.json").read_text())
        changes = report["remapped"][key]
        assert any(f"src_addr {moved}" in c and "dst_addr" in c for c in changes), changes
        assert list((work / "images" / key.replace("/", "_")).glob("tcp-stream-*.img")), key
        # held (packets dropped) from before any node restored until every node had
        local = "10.77.0.2:18515 -> 10.77.0.1:" if node == 2 else "10.77.0.1:"
        assert len(report["locked"]) == 1 and report["locked"][0].startswith(local), report["locked"]
        assert "locked" in report["phases"], report

    tcp = {}
    for role in ("server", "client"):
        m = TCP_RE.search((work / f"{role}.out").read_text())
        assert m, (work / f"{role}.out").read_text()
        tcp[role] = tuple(int(g) for g in m.groups())
    # every ping arrived once and in order across the move, and the END pings (sent after the
    # restore, when the stop file appeared) crossed the restored connection
    assert tcp["server"][2] == 0 and tcp["client"][2] == 0, tcp
    assert tcp["server"][0] == tcp["client"][1] and tcp["client"][0] == tcp["server"][1], tcp
    assert tcp["server"][0] > 0 and tcp["client"][0] > 0, tcp
