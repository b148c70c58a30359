"""A checkpoint that commits on the memory tier (MemoryCopyTarget.first, issue 27), through whole sessions on
the host (as test_memory_tier_sessions.py: real agents over TLS, coordinator, driver; CRIU a stand-in),
with S3 unreachable (a closed port on 127.0.0.1): node-x's copy, sealed with its signed part manifest,
reaches node-b's memory before the upload, the session reports MemoryKept, then fails on the upload. With
the checkpoint's manifest written to node-b as the operator does, a restore from memory alone stages the
same bytes, never asking S3; a manifest that is not ibckpt's is refused."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from agent.agent_harness import IMAGE_KEYS, Running
from agent.test_agent_disk import SECRET, agent_options, location, wait_finished
from agent.test_agent_session import checkpoint_request, registered_shim
from agent.test_memory_tier_sessions import RANK_KEY, dumped, node_x, the_same, token_file, unstage_kept
from pydantic import SecretStr

from ibckpt.agentapi import (
    ImageDestination,
    ImageSource,
    MemoryCopySource,
    MemoryCopyTarget,
    Milestone,
    RestoreRank,
    RestoreRequest,
    SessionReport,
)
from ibckpt.agentapi.memory import MemoryClient
from ibckpt.store.layout import CheckpointRef, Layout
from ibckpt.store.manifest import MANIFEST_KIND, PART_KIND, parse_manifest
from ibckpt.store.signing import ManifestKeys
from testbed.coordinator import ThreadedCoordinator
from testbed.s3 import S3Server

__all__ = ["dumped", "node_x", "token_file", "unstage_kept"]  # fixtures, used by name

REF = CheckpointRef("ring", "c1")
LAYOUT = Layout("lab")  # the location's prefix (test_agent_disk.location)


@dataclass(frozen=True)
class Unreachable:
    """An S3 endpoint where nothing listens: every call to it fails at once."""

    endpoint: str
    region: str = "us-east-1"
    bucket: str = "gone"
    access_key: str = "ak"
    secret_key: str = "sk"


@pytest.fixture
def no_s3() -> S3Server:
    with socket.socket() as sock:  # a port that was free a moment ago and is closed now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return cast(S3Server, Unreachable(f"http://127.0.0.1:{port}"))


def checkpoint_first(
    agent: Running, s3: S3Server, coordinator: ThreadedCoordinator, buddy: Running
) -> SessionReport:
    agent_options(agent, s3)
    session, tokens = coordinator.create_session({"node-x"})
    destination = ImageDestination(
        location=location(s3, "gone"), credentials=SECRET, job=REF.job, checkpoint_id=REF.checkpoint_id
    )
    target = MemoryCopyTarget(node="node-b", address=f"127.0.0.1:{buddy.port}", first=True)
    request = checkpoint_request(coordinator, session, tokens["node-x"]).model_copy(
        update={"images": destination, "memory_copy": target}
    )
    client = agent.client()
    client.checkpoint(request)
    return wait_finished(client, session, timeout_s=120)


def restore_from_memory(
    agent: Running, s3: S3Server, coordinator: ThreadedCoordinator, holder: Running
) -> SessionReport:
    agent_options(agent, s3)
    session, tokens = coordinator.create_session({agent.node})
    request = RestoreRequest(
        session_id=session,
        coordinator=f"127.0.0.1:{coordinator.port}",
        session_token=SecretStr(tokens[agent.node]),
        job=REF.job,
        checkpoint="ml/c1",
        images=ImageSource(
            location=location(s3, "gone"), credentials=SECRET, job=REF.job, checkpoint_id=REF.checkpoint_id
        ),
        ranks=[RestoreRank(container="main", rank_key=RANK_KEY, namespace="ml", pod="pod-c1")],
        memory_copies=[MemoryCopySource(node="node-b", address=f"127.0.0.1:{holder.port}", part="node-x")],
        memory_only=True,
    )
    client = agent.client()
    client.restore(request)
    return wait_finished(client, session, timeout_s=120)


def merged(part_bytes: bytes, keys: ManifestKeys = IMAGE_KEYS) -> bytes:
    """What the operator writes to the holders once it merged the parts: here one part, as a manifest."""
    part = parse_manifest(part_bytes, "the part", keys=IMAGE_KEYS, object_key=LAYOUT.part_key(REF, "node-x"))
    whole = part.model_copy(update={"kind": MANIFEST_KIND, "signature": None})
    return whole.signed(keys, LAYOUT.manifest_key(REF)).to_json()


def test_a_part_kept_first_commits_and_restores_from_memory_while_s3_is_away(
    dumped: dict[str, bytes],
    node_x: Running,
    token_file: Path,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    no_s3: S3Server,
    unstage_kept: Path,
) -> None:
    registered_shim(tmp_path / "state", sleeper.pid)
    node_b = Running(tmp_path / "holder", node="node-b", memory_budget=64 * 1024 * 1024)
    node_y = Running(tmp_path / "node-y", node="node-y", memory_token_file=token_file)
    try:
        report = checkpoint_first(node_x, no_s3, coordinator, node_b)
        assert report.state == "Failed" and "staging to" in report.message, report  # the upload's
        kept = report.memory_copy
        assert kept is not None and kept.kept and (kept.node, kept.part) == ("node-b", "node-x"), report
        assert Milestone.MEMORY_KEPT in report.phases and "memoryCopy" in report.phases, report.phases
        operator = MemoryClient("127.0.0.1", node_b.port, tls=node_b.pki.client(), token="op-token")
        [held] = operator.copies().copies
        assert (held.part, held.sealed, held.chunks, held.bytes) == ("node-x", True, kept.chunks, kept.bytes)
        data = operator.part_manifest(REF.job, REF.checkpoint_id, "node-x")
        assert data is not None
        part = parse_manifest(data, "node-b", keys=IMAGE_KEYS, object_key=LAYOUT.part_key(REF, "node-x"))
        distinct = {c.id for record in part.files for c in record.chunks}
        assert part.kind == PART_KIND and len(distinct) == kept.chunks >= 3
        assert [r.root for r in part.ranks] == ["node-x/pod-c1.main"]

        # the operator commits on memory: the checkpoint's signed manifest beside the copy
        operator.put_manifest(REF.job, REF.checkpoint_id, merged(data))
        restored = restore_from_memory(node_y, no_s3, coordinator, node_b)
        assert restored.state == "Failed" and "dumped without the container runtime" in restored.message
        read = restored.memory_copy
        assert read is not None and read.kept and read.chunks == len(distinct), restored
        assert the_same(unstage_kept, dumped)

        # a manifest signed with a key that is not ibckpt's is refused, nothing is staged
        forged = ManifestKeys({"zz-forged": b"f" * 32})
        operator.put_manifest(REF.job, REF.checkpoint_id, merged(data, forged))
        refused = restore_from_memory(node_y, no_s3, coordinator, node_b)
        assert refused.state == "Failed" and "not in the image key set" in refused.message, refused
        assert "from memory alone" in refused.message

        # the copy gone: the restore fails, naming what it could not read, and never asks S3
        operator.drop(REF.job, REF.checkpoint_id)
        gone = restore_from_memory(node_y, no_s3, coordinator, node_b)
        assert gone.state == "Failed" and "no holder keeps the manifest of ring/c1" in gone.message, gone
    finally:
        node_y.stop()
        node_b.stop()


def test_a_first_copy_the_holder_cannot_take_leaves_the_upload_to_go_on(
    dumped: dict[str, bytes],
    node_x: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
) -> None:
    bucket = "memfirst-" + str(tmp_path.name)[-8:].lower().replace("_", "-")
    s3_server.create_bucket(bucket)
    registered_shim(tmp_path / "state", sleeper.pid)
    node_b = Running(tmp_path / "holder", node="node-b", memory_budget=1024 * 1024)
    try:
        agent_options(node_x, s3_server)
        session, tokens = coordinator.create_session({"node-x"})
        destination = ImageDestination(
            location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"
        )
        target = MemoryCopyTarget(node="node-b", address=f"127.0.0.1:{node_b.port}", first=True)
        request = checkpoint_request(coordinator, session, tokens["node-x"]).model_copy(
            update={"images": destination, "memory_copy": target}
        )
        client = node_x.client()
        client.checkpoint(request)
        report = wait_finished(client, session, timeout_s=120)
        copies: Any = MemoryClient(
            "127.0.0.1", node_b.port, tls=node_b.pki.client(), token="op-token"
        ).copies()
    finally:
        node_b.stop()
    assert (report.state, report.phase) == ("Succeeded", "Succeeded"), report
    kept = report.memory_copy
    assert kept is not None and not kept.kept and "memory tier is full" in kept.message, kept
    assert Milestone.MEMORY_KEPT not in report.phases and Milestone.UPLOADED in report.phases
    assert copies.copies == []  # and not copied again after the upload
