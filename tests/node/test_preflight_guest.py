"""A checkpoint is refused before anything is touched: a rank holds a TCP connection outside the job.

The two rc_seq ranks run on nodes A and B; rank 0 also holds an idle TCP connection to a
listener on the host (10.0.2.100 in the guests, qemu's user network: not a node of the job).
Both agents run a LeaveRunning checkpoint without --job-addr, so the job's addresses are the
ones the two nodes publish (10.77.0.x and each guest's own). Node A's preflight finds the
connection and refuses, naming the rank, its pid and the connection; the coordinator's abort
makes node B refuse too; both CLIs exit non-zero. No rank was gated or dumped, and the job
finishes with every message delivered exactly once. The agents' JSON reports show that no
shim phase ran.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from node.rc_pair import START, assert_exactly_once, assert_ok, on_both_nodes

from testbed.guest import GUEST_HOST_ADDR

pytestmark = pytest.mark.twoguests

BODY = (
    START
    + """
extra=""
[ $role = server ] && extra="-x {host}:{outsider}"
start_rank $extra
echo $pid > {work}/$role.pid
sleep 2
{python} -m ibckpt_native.control /run/ibckpt/$role.ctl status > {work}/status-before-$role.json
if agent checkpoint --rank "$key=$pid:/run/ibckpt/$role.ctl" --images {work}/images --mode LeaveRunning \\
    > {work}/ckpt-node-$IBCKPT_NODE.json 2> {work}/refused-node-$IBCKPT_NODE.txt; then
  echo "UNEXPECTED: the checkpoint went through"; exit 3
fi
echo "node-$IBCKPT_NODE refused"
sleep 2  # the job carries on
stop_when_both_ready
wait_result
"""
)


@pytest.fixture
def outsider() -> Iterator[int]:
    """A TCP listener on the host's loopback that accepts and holds connections."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):  # the server closed: the test is over
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_tcp_peer_outside_the_job_refuses_the_checkpoint_on_every_node(  # type: ignore[no-untyped-def]
    coordinator, tmp_path: Path, outsider: int
) -> None:
    work = tmp_path
    body = BODY.replace("{host}", GUEST_HOST_ADDR).replace("{outsider}", str(outsider))
    results = on_both_nodes(coordinator, work, body, forward=(outsider,))
    assert_ok(results, "refused checkpoint", work)
    assert "node-1 refused" in results[0].output and "node-2 refused" in results[1].output

    pid = int((work / "server.pid").read_text())
    refused = {n: (work / f"refused-node-{n}.txt").read_text() for n in (1, 2)}
    pattern = (
        rf"refusing to checkpoint ring/rank-0/main/0 \(pid {pid}\): TCP connection \S+ -> "
        rf"{re.escape(GUEST_HOST_ADDR)}:{outsider} \(ESTABLISHED\) leads outside the job "
        r"\(job addresses: [^)]*10\.77\.0\.1"
    )
    for n in (1, 2):
        assert re.search(pattern, refused[n]), refused[n]
    assert "ibckpt-node: checkpoint failed: node-1: refusing" in refused[1], refused[1]
    assert "node-1: refusing" in refused[2], refused[2]  # through the coordinator's abort
    assert "rank-1" not in refused[1] and "rank-1" not in refused[2]  # rank 1 holds nothing outside
    assert not (work / "images").exists()

    for n in (1, 2):
        # the CLI's report of what it did: refused, and no shim phase ever ran (only `status`)
        report = json.loads((work / f"ckpt-node-{n}.json").read_text())
        assert report["outcome"] == "Refused" and report["shim"] == {} and report["images"] == {}, report
        assert "Quiesced" not in report["phases"] and "Quiesced" not in report["local"], report
    for role, peer in (("server", "client"), ("client", "server")):
        before = json.loads((work / f"status-before-{role}.json").read_text())
        # the shim reports its QP's peer as the app connected it: the other rank's QP
        other = json.loads((work / f"status-before-{peer}.json").read_text())
        assert [p["peer_qpn"] for p in before["peers"]] == [q["qpn"] for q in other["qps"]], before
        assert before["peers"][0]["peer_gid"] in other["gids"], (before, other)
        assert before["unsupported"] == [] and before["checkpoints"] == 0
    assert_exactly_once(work, results)
