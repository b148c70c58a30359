"""The node agent's memory tier (docs/recovery.md, "Tiers"): the shelf's rules (pure), its routes on the
real agent server over TLS, and a node's part kept in another agent's memory and read back by a restore,
with the real S3 (tokens are reviewed by the harness's stub; the real TokenReview and audience are
tests/helm/test_chart.py's, on the cluster)."""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent.agent_harness import IMAGE_KEYS, Running

from ibckpt.agentapi import ImageDestination, MemoryCopySource, MemoryCopyTarget, SecretRef
from ibckpt.agentapi.client import AgentError
from ibckpt.agentapi.memory import (
    COPIES,
    PIECE_BYTES,
    MemoryClient,
    MemorySeal,
    copy_path,
    manifest_path,
    parse_copy_path,
    parse_manifest_path,
)
from ibckpt.api import S3Location
from ibckpt.store import ImageStore
from ibckpt_node.agent import memorycopies
from ibckpt_node.agent.memorytier import UNSEALED_S, MemoryShelf, ShelfError
from ibckpt_node.agent.staging import StagedPart, stage_part, store_config
from testbed.s3 import S3Server

KEY = ("ns/ring", "c1", "node-1")
HOLDER_BUDGET = 32 * 1024 * 1024
ONE = "1" * 64
TWO = "2" * 64


def sealed(shelf: MemoryShelf, key: tuple[str, str, str], data: bytes, cid: str = ONE) -> None:
    shelf.put_piece(key, 0, data)
    shelf.seal(key, MemorySeal(chunks={cid: (0, len(data))}, bytes=len(data)))


# -- the shelf ---------------------------------------------------------------------------------------------


def test_a_copy_arrives_in_order_and_is_served_only_once_sealed() -> None:
    shelf = MemoryShelf("node-2", 100)
    shelf.put_piece(KEY, 0, b"abc")
    with pytest.raises(ShelfError, match="piece 2 out of order") as refused:
        shelf.put_piece(KEY, 2, b"x")
    assert refused.value.status == 409
    shelf.put_piece(KEY, 1, b"defg")
    assert shelf.chunk(KEY, ONE) is None  # not sealed yet
    shelf.seal(KEY, MemorySeal(chunks={ONE: (0, 3), TWO: (3, 4)}, bytes=7))
    one, two = shelf.chunk(KEY, ONE), shelf.chunk(KEY, TWO)
    assert one is not None and two is not None and (bytes(one), bytes(two)) == (b"abc", b"defg")
    with pytest.raises(ShelfError, match="out of order"):
        shelf.put_piece(KEY, 2, b"more")  # a sealed copy takes no more pieces


def test_a_seal_that_does_not_match_what_arrived_drops_the_copy() -> None:
    shelf = MemoryShelf("node-2", 100)
    shelf.put_piece(KEY, 0, b"abc")
    with pytest.raises(ShelfError, match="3 bytes arrived, the seal says 4"):
        shelf.seal(KEY, MemorySeal(chunks={ONE: (0, 3)}, bytes=4))
    shelf.put_piece(KEY, 0, b"abc")
    with pytest.raises(ShelfError, match="is not inside the copy"):
        shelf.seal(KEY, MemorySeal(chunks={ONE: (2, 5)}, bytes=3))
    assert shelf.listing().copies == []


def test_the_budget_drops_the_oldest_copies_first_and_refuses_what_cannot_fit() -> None:
    shelf = MemoryShelf("node-2", 10)
    sealed(shelf, ("ns/a", "c1", "node-1"), b"aaaa")
    sealed(shelf, ("ns/b", "c1", "node-1"), b"bbbb")
    sealed(shelf, ("ns/c", "c1", "node-1"), b"cccc")  # over 10: ns/a's goes
    assert [c.job for c in shelf.listing().copies] == ["ns/b", "ns/c"]
    with pytest.raises(ShelfError, match=r"memory tier is full: 0\.0 MiB budget") as full:
        shelf.put_piece(("ns/d", "c1", "node-1"), 0, b"d" * 11)
    assert full.value.status == 507
    assert [c.job for c in shelf.listing().copies] == []  # every older copy went trying, then this one


def test_a_newer_copy_of_a_part_replaces_the_older_and_a_budget_of_0_keeps_nothing() -> None:
    shelf = MemoryShelf("node-2", 100)
    sealed(shelf, ("ns/ring", "c1", "node-1"), b"old")
    sealed(shelf, ("ns/ring", "c1", "node-3"), b"other part")
    sealed(shelf, ("ns/ring", "c2", "node-1"), b"new")
    assert [(c.checkpoint, c.part) for c in shelf.listing().copies] == [("c1", "node-3"), ("c2", "node-1")]
    assert shelf.drop("ns/ring", "c1") == 1
    with pytest.raises(ShelfError, match="keeps no memory tier") as off:
        MemoryShelf("node-2", 0).put_piece(KEY, 0, b"x")
    assert off.value.status == 507


def test_an_unsealed_copy_is_dropped_after_its_bound() -> None:
    now = [1000.0]
    shelf = MemoryShelf("node-2", 100, clock=lambda: now[0])
    shelf.put_piece(KEY, 0, b"abc")
    now[0] += UNSEALED_S + 1
    assert shelf.listing().copies == []


def test_a_checkpoints_manifest_counts_in_the_budget_and_goes_with_its_last_copy() -> None:
    shelf = MemoryShelf("node-2", 40)
    with pytest.raises(ShelfError, match="holds no copy of ns/ring/c1") as none:
        shelf.put_manifest("ns/ring", "c1", b"{}")  # no use without its copies
    assert none.value.status == 404
    shelf.put_piece(KEY, 0, b"abcd")
    shelf.seal(KEY, MemorySeal(chunks={ONE: (0, 4)}, bytes=4, manifest='{"part":1}'))
    assert shelf.part_manifest(KEY) == b'{"part":1}' and shelf.used == 14
    other = ("ns/ring", "c1", "node-3")
    sealed(shelf, other, b"efgh")
    shelf.put_manifest("ns/ring", "c1", b"m" * 10)
    shelf.put_manifest("ns/ring", "c1", b"n" * 12)  # replaces the first: its bytes are counted once
    assert shelf.manifest("ns/ring", "c1") == b"n" * 12 and shelf.used == 30
    with pytest.raises(ShelfError, match="memory tier is full") as full:
        shelf.put_manifest("ns/ring", "c1", b"o" * 30)  # its own copies are not dropped for it
    assert full.value.status == 507 and shelf.manifest("ns/ring", "c1") == b"n" * 12
    # a newer checkpoint of one part replaces that copy; the manifest stays with the other part's
    sealed(shelf, ("ns/ring", "c2", "node-1"), b"new")
    assert shelf.manifest("ns/ring", "c1") is not None and shelf.part_manifest(KEY) is None
    sealed(shelf, ("ns/ring", "c2", "node-3"), b"new")  # c1's last copy goes, and its manifest
    assert shelf.manifest("ns/ring", "c1") is None and shelf.used == 6
    shelf.put_manifest("ns/ring", "c2", b"m")
    assert shelf.drop("ns/ring", "c2") == 2 and shelf.manifest("ns/ring", "c2") is None


def test_a_copys_path_round_trips_a_namespaced_job() -> None:
    path = copy_path("ns/ring", "c1", "node-1")
    assert path == f"{COPIES}/ns%2Fring/c1/node-1"
    assert parse_copy_path(path + f"/chunks/{ONE}") == ("ns/ring", "c1", "node-1", "chunks", ONE)
    assert parse_copy_path(path + "/seal") == ("ns/ring", "c1", "node-1", "seal", None)
    assert parse_copy_path(f"{COPIES}/ns%2Fring/c1") == ("ns/ring", "c1", None, None, None)
    assert parse_copy_path(path + "/chunks") is None and parse_copy_path("/v1/info") is None


# -- the routes ----------------------------------------------------------------------------------------------


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Running]:
    running = Running(tmp_path / "holder", node="node-2", memory_budget=HOLDER_BUDGET)
    yield running
    running.stop()


def memory_client(agent: Running, token: str = "agent-token") -> MemoryClient:
    return MemoryClient("127.0.0.1", agent.port, tls=agent.pki.client(), token=token, timeout_s=5)


def test_the_agents_token_opens_the_memory_routes_and_nothing_else(holder: Running) -> None:
    assert memory_client(holder).copies().budget == HOLDER_BUDGET
    assert memory_client(holder, "op-token").copies().node == "node-2"  # the operator lists too
    status, _, body = holder.raw("GET", "/v1/info", {"Authorization": "Bearer agent-token"})
    assert status == 403 and b"may not use the node agent" in body
    status, _, body = holder.raw("GET", COPIES, {"Authorization": "Bearer other-token"})
    assert status == 403, body
    status, _, _ = holder.raw("GET", COPIES)
    assert status == 401
    # a piece is at most 1 MiB, the server's body limit: refused from its Content-Length, before the body
    # (a client still sending it would race the server's close)
    with holder.tls_socket() as sock:
        head = f"PUT {copy_path(*KEY)}/pieces/0 HTTP/1.1\r\nHost: agent\r\n"
        head += f"Authorization: Bearer agent-token\r\nContent-Length: {PIECE_BYTES + 1}\r\n\r\n"
        sock.sendall(head.encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
    # over the budget: 507, and the message says why
    client = memory_client(holder)
    for index in range(HOLDER_BUDGET // PIECE_BYTES):
        client.put_piece(*KEY, index, b"p" * PIECE_BYTES)
    status, _, body = holder.raw(
        "PUT",
        copy_path(*KEY) + f"/pieces/{HOLDER_BUDGET // PIECE_BYTES}",
        {"Authorization": "Bearer agent-token"},
        b"p",
    )
    assert status == 507 and "memory tier is full: 32.0 MiB budget" in json.loads(body)["error"], body
    assert memory_client(holder).copies().used == 0  # the copy that did not fit is gone


def test_the_holder_keeps_a_part_manifest_with_its_copy_and_the_checkpoints_beside_them(
    tmp_path: Path,
) -> None:
    holder = Running(tmp_path / "small", node="node-3", memory_budget=64)
    try:
        agent, operator = memory_client(holder), memory_client(holder, "op-token")
        assert operator.manifest("ns/ring", "c1") is None and agent.part_manifest(*KEY) is None
        agent.put_piece(*KEY, 0, b"abcd")
        assert agent.part_manifest(*KEY) is None  # not sealed yet
        agent.seal(*KEY, MemorySeal(chunks={ONE: (0, 4)}, bytes=4, manifest='{"part": "node-1"}'))
        assert agent.part_manifest(*KEY) == b'{"part": "node-1"}'
        with pytest.raises(AgentError) as none:
            operator.put_manifest("ns/ring", "c2", b"{}")
        assert none.value.status == 404
        operator.put_manifest("ns/ring", "c1", b'{"merged": true}')
        assert agent.manifest("ns/ring", "c1") == b'{"merged": true}'
        assert operator.copies().used == 4 + 18 + 16
        with pytest.raises(AgentError, match="memory tier is full") as full:
            operator.put_manifest("ns/ring", "c1", b"m" * 64)
        assert full.value.status == 507 and agent.manifest("ns/ring", "c1") == b'{"merged": true}'
        status, _, body = holder.raw("GET", manifest_path("ns/ring", "c1"), {"Authorization": "Bearer other"})
        assert status in (401, 403), body  # the harness's stub knows no such token
        operator.drop("ns/ring", "c1")
        assert operator.manifest("ns/ring", "c1") is None and operator.copies().used == 0
    finally:
        holder.stop()
    assert parse_manifest_path(manifest_path("ns/ring", "c1")) == ("ns/ring", "c1")
    assert parse_copy_path(copy_path(*KEY) + "/manifest/x") is None


# -- a part kept on another agent, and read back -------------------------------------------------------


def staged(s3: S3Server, tmp_path: Path, **location: object) -> StagedPart:
    """node-1's images (a page file of several chunks, small files) staged as its part of ns/ring c1."""
    bucket = "memory-" + secrets.token_hex(6)
    s3.create_bucket(bucket)
    images = tmp_path / "images"
    for name, data in {
        "ring-0.main/pages-1.img": os.urandom(9 * 1024 * 1024 + 5),
        "ring-0.main/core-1.img": b"core" * 100,
        "ring-0.main/fdinfo-2.img": b"fd" * 50,
    }.items():
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes(data)
    destination = ImageDestination(
        location=S3Location.model_validate({"endpoint": s3.endpoint, "region": s3.region, "bucket": bucket,
                                            "credentialsSecretRef": {"name": "s3"}, **location}),
        credentials=SecretRef(namespace="ibckpt", name="s3"), job="ns/ring", checkpoint_id="c1",
    )  # fmt: skip
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    secret = {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}
    config = store_config(destination.location, destination.credentials, secret)
    part = stage_part(
        config, destination, "node-1", images, [("ring-0.main", "ring-0")], lambda n: None, IMAGE_KEYS
    )
    part.store.commit_parts("ns/ring", "c1", ["node-1"])
    return part


def test_a_part_kept_in_another_agents_memory_is_what_a_restore_reads(
    s3_server: S3Server, holder: Running, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("agent-token\n")
    part = staged(s3_server, tmp_path)
    target = MemoryCopyTarget(node="node-2", address=f"127.0.0.1:{holder.port}")
    deadline = time.monotonic() + 60
    kept = memorycopies.keep(part.store, part.part, tmp_path / "images", "node-1", target, token,
                             holder.pki.client(), deadline)  # fmt: skip
    distinct = {c.id for record in part.part.files for c in record.chunks}
    assert kept.kept and kept.chunks == len(distinct) > 2 and kept.bytes > 9 * 1024 * 1024, kept
    [copy] = memory_client(holder).copies().copies
    assert (copy.job, copy.checkpoint, copy.part, copy.sealed) == ("ns/ring", "c1", "node-1", True)
    assert copy.chunks == len(distinct)

    def restore(into: str) -> tuple[ImageStore, memorycopies.CopyReader]:
        source = MemoryCopySource(node="node-2", address=target.address, part="node-1")
        client = memorycopies.client(target.address, token, holder.pki.client())
        reader = memorycopies.CopyReader("ns/ring", "c1", [(source, client)])
        store = ImageStore.open(part.store.config, signing=IMAGE_KEYS)
        reader.tally(
            store.restore(part.part.ref, tmp_path / into, subtree="node-1/ring-0.main", chunk_source=reader)
        )
        return store, reader

    _, reader = restore("from-memory")
    assert (reader.chunks, reader.rejected) == (len(distinct), 0)
    assert reader.report().node == "node-2" and reader.report().kept
    for name in ("pages-1.img", "core-1.img", "fdinfo-2.img"):
        assert (tmp_path / "from-memory" / name).read_bytes() == (
            tmp_path / "images/ring-0.main" / name
        ).read_bytes()

    # the holder dropped it (a newer checkpoint, its budget): the same restore reads S3
    memory_client(holder, "op-token").drop("ns/ring", "c1")
    _, reader = restore("from-s3")
    assert reader.chunks == 0 and not reader.report().kept
    assert (tmp_path / "from-s3/pages-1.img").read_bytes() == (
        tmp_path / "images/ring-0.main/pages-1.img"
    ).read_bytes()


def test_a_copy_the_holder_cannot_take_leaves_the_part_in_s3_and_says_why(
    s3_server: S3Server, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("agent-token")
    part = staged(s3_server, tmp_path)
    small = Running(tmp_path / "small", node="node-3", memory_budget=1024 * 1024)
    try:
        target = MemoryCopyTarget(node="node-3", address=f"127.0.0.1:{small.port}")
        kept = memorycopies.keep(part.store, part.part, tmp_path / "images", "node-1", target, token,
                                 small.pki.client(), time.monotonic() + 60)  # fmt: skip
        assert not kept.kept and "memory tier is full: 1.0 MiB budget" in kept.message, kept
        assert memory_client(small).copies().copies == []
    finally:
        small.stop()
    # and a holder that is gone
    gone = MemoryCopyTarget(node="node-4", address="127.0.0.1:9")
    kept = memorycopies.keep(part.store, part.part, tmp_path / "images", "node-1", gone, token,
                             small.pki.client(), time.monotonic() + 60)  # fmt: skip
    assert not kept.kept and kept.message.startswith("not kept on node-4:"), kept
