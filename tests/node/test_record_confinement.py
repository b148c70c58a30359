"""The node driver tells the shims' proxy each rank's GIDs and QPs before the rank may publish a
record: a container's rebuild writes its own records, and a record naming another container's QP is
refused, under another GID or under a GID both hold (ranks restored from one node share it).
Fake shims on the host that publish through their container's real coordinator socket, as the real
shim's rebuild does (native/src/rebuild.c: records under the GIDs its `status` lists)."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from node.driver_harness import connected_driver, unwritable_images
from node.fake_shim import FakeShimSocket

from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode
from ibckpt_node.coord_proxy import ShimCoordinatorProxy, channels_for
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator

G = "fe800000000000000000000000000001"
H = "fe800000000000000000000000000002"


def put(coord: Path, line: str) -> str:
    """One request through a container's coordinator socket, as native/src/coord.c sends it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(coord))
        sock.sendall(line.encode() + b"\n")
        return sock.makefile().readline().rstrip("\n")


class PublishingShim(FakeShimSocket):
    """A rank holding QP `qpn` at `gid`: its rebuild publishes that QP's records, and `forged` lines too."""

    def __init__(
        self, path: Path, gid: str, qpn: int, forged: list[str], everyone: threading.Barrier
    ) -> None:
        super().__init__(path)
        self.gid, self.qpn, self.forged, self.everyone = gid, qpn, forged, everyone
        self.coord = path.parent.parent / "coord" / "coord.sock"
        self.published: list[str] = []  # the proxy's replies to its PUTs

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "abort" and self.state == "released":
            return False, {"phase": "abort", "ok": False, "state": "released"}
        if verb == "status":
            return True, {"state": self.state, "gids": [self.gid], "qps": [{"qpn": self.qpn, "type": 2}]}
        if verb == "rebuild":
            lines = [f"PUT map/{self.gid}/{self.qpn} real", f"PUT e2/qp/{self.gid}/{self.qpn} rec"]
            self.published = [put(self.coord, line) for line in lines]
            self.everyone.wait(timeout=5)  # the other container's records are in: a forgery would win
            self.published += [put(self.coord, line) for line in self.forged]
        return super().answer(verb)


def two_containers(tmp_path: Path, pid: int, b_gid: str) -> tuple[list[PublishingShim], list[LocalRank]]:
    """Containers a (QP 7 at GID G) and b (QP 8 at `b_gid`, which also tries to write a's record)."""
    everyone = threading.Barrier(2)
    shims = []
    for cid, gid, qpn, forged in (("a", G, 7, []), ("b", b_gid, 8, [f"PUT e2/qp/{G}/7 forged"])):
        (tmp_path / cid / "ctl").mkdir(parents=True)
        (tmp_path / cid / "coord").mkdir()
        shims.append(PublishingShim(tmp_path / cid / "ctl" / "1.sock", gid, qpn, forged, everyone))
    ranks = [LocalRank(RankId.parse(f"job/pod-{i}/main/0"), pid, s.path) for i, s in enumerate(shims)]
    return shims, ranks


REFUSED = {
    H: f"ERR refused: GID {G} is not one of this container's ranks' GIDs",
    G: f"ERR refused: QP 7 of GID {G} is not one of this container's ranks' QPs",
}


@pytest.mark.parametrize("b_gid", [H, G], ids=["other-gid", "shared-gid"])
@pytest.mark.parametrize("path", ["restore", "abort"])
async def test_each_rank_publishes_its_own_records_and_not_anothers(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int, path: str, b_gid: str
) -> None:
    """A restore's rebuild (of ranks held released) and an abort's (after a failed dump): each rank's
    own records go through, the forgery is refused and the record read is the owner's, whether the
    forger's rank has a GID of its own or shares the owner's."""
    shims, ranks = two_containers(tmp_path, sleeper, b_gid)
    driver = await connected_driver(coordinator, [] if path == "restore" else ranks)
    client = driver.client
    try:
        async with ShimCoordinatorProxy(
            client, channels_for((r.control_path, r.pid) for r in ranks)
        ) as proxy:
            driver.confine, driver.flush_records = proxy.confine, proxy.published
            if path == "restore":
                for s in shims:
                    s.state = "released"
                report = await asyncio.wait_for(driver.restore({}, {}, epoch=2, rejoin=ranks), 30)
                assert report.outcome == "Succeeded"
            else:
                with pytest.raises(CheckpointFailed, match="not empty"):
                    await asyncio.wait_for(
                        driver.checkpoint(Mode.STOP, unwritable_images(tmp_path, ranks), 2), 30
                    )
                assert driver.report.outcome == "Aborted"
                assert [s.state for s in shims] == ["running", "running"]
            await proxy.published()
            assert await asyncio.to_thread(put, shims[1].coord, f"GET e2/qp/{G}/7 0") == "VAL rec"
    finally:
        await client.close()
    for s in shims:
        assert [c for c in s.commands if c != "reserve"][-3:] == ["status", "rebuild", "resume"], s.commands
    # QPNs reserved before the rebuild: the other rank's, when it shares the GID (qpn_reserve.py)
    reserved = [[line for line in s.lines if line.startswith("reserve ")] for s in shims]
    shared = b_gid == G
    assert reserved == (
        [["reserve 0", "reserve 8 1"], ["reserve 0", "reserve 7 1"]] if shared else [["reserve 0"]] * 2
    )
    assert shims[0].published == ["OK", "OK"]
    assert shims[1].published == ["OK", "OK", REFUSED[b_gid]]
