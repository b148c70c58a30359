"""The memory tier through whole sessions on the host (as test_agent_preupload.py: real agent servers over
TLS, registry, coordinator, driver and SeaweedFS; the shim a fake control socket, CRIU a stand-in): node-x
checkpoints with its copy on node-b's agent, then a restore session on node-y reads that copy before S3.
With the bucket's chunks taken away the restore still stages the same bytes, so every chunk came from
node-b's memory; with the copy dropped, or node-b gone, it reads S3. A holder with no budget leaves the
part in S3 and the checkpoint succeeds. And who may call the memory routes: the agents' token opens
nothing else, and the operator's calls there pass the leader fence as its others do."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from agent.agent_harness import IMAGE_KEYS, Running, stand_in_criu
from agent.test_agent_disk import SECRET, agent_options, location, secret_data, wait_finished
from agent.test_agent_session import checkpoint_request, registered_shim
from pydantic import SecretStr

from ibckpt.agentapi import (
    ImageDestination,
    ImageSource,
    LeaderEpoch,
    MemoryCopySource,
    MemoryCopyTarget,
    RestoreRank,
    RestoreRequest,
    SessionReport,
    format_epoch,
)
from ibckpt.agentapi.memory import COPIES, MemoryClient, copy_path
from ibckpt.agentapi.models import LEADER_EPOCH_HEADER
from ibckpt.store import ImageStore
from ibckpt.store.layout import Layout
from ibckpt.store.manifest import Manifest
from ibckpt_node.agent import restoring
from ibckpt_node.agent.staging import store_config
from testbed.coordinator import ThreadedCoordinator
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

TREE = "pod-c1.main"  # registered_shim's container c1: pod pod-c1, container main
RANK_KEY = "ring/pod-c1/main/1"
CHUNKS_PREFIX = Layout("lab").chunks  # the location's prefix (test_agent_disk.location)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """The agents' memory-tier token, as the chart's projected volume holds it."""
    path = tmp_path / "memory-tier" / "token"
    path.parent.mkdir()
    path.write_text("agent-token\n")
    return path


@pytest.fixture
def dumped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """A PATH whose criu 'dumps' a pages file of several chunks and a small file; their bytes by name."""
    files = {"pages-1.img": os.urandom(9 * 1024 * 1024 + 321), "core-1.img": b"core" * 300}
    sources = tmp_path / "dumped-by-criu"
    sources.mkdir()
    for name, data in files.items():
        (sources / name).write_bytes(data)
    stand_in_criu(
        tmp_path,
        "import shutil, sys\n"
        "args = sys.argv[1:]\n"
        "if args[:1] == ['dump']:\n"
        f"    for name in {sorted(files)!r}:\n"
        f"        shutil.copyfile({str(sources)!r} + '/' + name, args[args.index('-D') + 1] + '/' + name)\n",
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return files


@pytest.fixture
def node_x(tmp_path: Path, token_file: Path) -> Iterator[Running]:
    """The checkpointing node's agent (registry in tmp_path/state, where registered_shim puts c1)."""
    running = Running(tmp_path / "state", node="node-x", memory_token_file=token_file)
    yield running
    running.stop()


def holder(tmp_path: Path, budget: int, token_file: Path | None = None) -> Running:
    """node-b's agent, holding up to `budget` bytes for the others (`token_file`: it reads copies too)."""
    return Running(
        tmp_path / f"holder-{budget}", node="node-b", memory_budget=budget, memory_token_file=token_file
    )


def checkpoint(
    agent: Running, s3: S3Server, bucket: str, coordinator: ThreadedCoordinator, buddy: Running
) -> SessionReport:
    """ring/c1 of node-x's container c1, its copy on `buddy`: the finished session's report."""
    agent_options(agent, s3)
    session, tokens = coordinator.create_session({"node-x"})
    destination = ImageDestination(
        location=location(s3, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"
    )
    request = checkpoint_request(coordinator, session, tokens["node-x"]).model_copy(
        update={
            "images": destination,
            "memory_copy": MemoryCopyTarget(node="node-b", address=f"127.0.0.1:{buddy.port}"),
        }
    )
    client = agent.client()
    client.checkpoint(request)
    report = wait_finished(client, session, timeout_s=120)
    # the copy follows the session's report (a job commits on S3 without waiting for it); the report
    # says how it went once the images are removed
    deadline = time.monotonic() + 60
    while report.memory_copy is None and time.monotonic() < deadline:
        time.sleep(0.2)
        report = client.session(session)
    return report


def commit(s3: S3Server, bucket: str) -> tuple[ImageStore, Manifest]:
    store = ImageStore.open(store_config(location(s3, bucket), SECRET, secret_data(s3)), signing=IMAGE_KEYS)
    return store, store.commit_parts("ring", "c1", ["node-x"])


def restore(
    agent: Running,
    s3: S3Server,
    bucket: str,
    coordinator: ThreadedCoordinator,
    copies: Sequence[MemoryCopySource],
    staged: Path,
) -> SessionReport:
    """A restore session of ring/c1's pod-c1 on `agent`, reading `copies` first. The stand-in dumped
    without the container runtime, so the session fails once the tree is staged, before the runtime would
    restore it; what it staged is in `staged` then (the unstage_kept fixture copies it aside)."""
    agent_options(agent, s3)
    session, tokens = coordinator.create_session({agent.node})
    request = RestoreRequest(
        session_id=session,
        coordinator=f"127.0.0.1:{coordinator.port}",
        session_token=SecretStr(tokens[agent.node]),
        job="ring",
        checkpoint="ml/c1",
        images=ImageSource(location=location(s3, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"),
        ranks=[RestoreRank(container="main", rank_key=RANK_KEY, namespace="ml", pod="pod-c1")],
        memory_copies=list(copies) or None,
    )
    client = agent.client()
    client.restore(request)
    report = wait_finished(client, session, timeout_s=120)
    assert report.state == "Failed" and "dumped without the container runtime" in report.message, report
    assert (staged / "pages-1.img").is_file(), report
    return report


@pytest.fixture
def unstage_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where each restore session's staged images are copied before the session removes them."""
    kept = tmp_path / "staged"
    original = restoring.unstage

    def copy_then_unstage(
        planned: Sequence[restoring.ContainerRestore], restore_dir: Callable[[str, str, str], str]
    ) -> None:
        shutil.rmtree(kept, ignore_errors=True)
        for item in planned:
            images = Path(restore_dir(item.namespace, item.pod, item.container), "images")
            if images.is_dir():
                shutil.copytree(images, kept)
        original(planned, restore_dir)

    monkeypatch.setattr(restoring, "unstage", copy_then_unstage)
    return kept


def the_same(staged: Path, files: dict[str, bytes]) -> bool:
    return all((staged / name).read_bytes() == data for name, data in files.items())


def test_a_restore_reads_the_copy_a_checkpoint_kept_on_its_buddy_then_s3_once_it_is_gone(
    dumped: dict[str, bytes],
    node_x: Running,
    token_file: Path,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
    unstage_kept: Path,
) -> None:
    bucket = "memtier-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    registered_shim(tmp_path / "state", sleeper.pid)
    node_b = holder(tmp_path, 64 * 1024 * 1024, token_file)
    node_y = Running(tmp_path / "node-y", node="node-y", memory_token_file=token_file)
    try:
        report = checkpoint(node_x, s3_server, bucket, coordinator, node_b)
        assert (report.state, report.phase) == ("Succeeded", "Succeeded"), report
        _, manifest = commit(s3_server, bucket)
        distinct = {c.id for record in manifest.files for c in record.chunks}
        kept = report.memory_copy
        assert kept is not None and kept.kept, report
        assert (kept.node, kept.part, kept.chunks) == ("node-b", "node-x", len(distinct)), kept
        assert len(distinct) >= 3 and kept.bytes > 9 * 1024 * 1024 and "memoryCopy" in report.phases
        operator = MemoryClient("127.0.0.1", node_b.port, tls=node_b.pki.client(), token="op-token")
        [held] = operator.copies().copies
        assert (held.job, held.checkpoint, held.part, held.sealed, held.chunks) == (
            "ring", "c1", "node-x", True, len(distinct)
        )  # fmt: skip
        assert not (tmp_path / "state" / "sessions" / report.session_id / "images").exists()

        # the bucket without its chunks: a restore can only have them from node-b's memory
        s3 = s3_server.client()
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=CHUNKS_PREFIX)["Contents"]
        chunks = {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}
        assert len(chunks) == len(distinct)
        for key in chunks:
            s3.delete_object(Bucket=bucket, Key=key)
        copy = MemoryCopySource(node="node-b", address=f"127.0.0.1:{node_b.port}", part="node-x")
        restored = restore(node_y, s3_server, bucket, coordinator, [copy], unstage_kept)
        read = restored.memory_copy
        assert read is not None and read.kept, restored
        assert (read.node, read.part, read.chunks) == ("node-b", "node-x", len(distinct)), read
        assert read.bytes == kept.bytes and read.message.startswith(f"{len(distinct)} chunks from memory")
        assert the_same(unstage_kept, dumped)

        # a restore on the holder itself reads its own shelf in-process: the address it is given is no
        # server, and S3 has no chunk
        here = MemoryCopySource(node="node-b", address="127.0.0.1:1", part="node-x")
        restored = restore(node_b, s3_server, bucket, coordinator, [here], unstage_kept)
        read = restored.memory_copy
        assert read is not None and read.kept and read.chunks == len(distinct), restored
        assert the_same(unstage_kept, dumped)

        # the chunks back in S3, the copy dropped (the operator deletes a checkpoint's copies): S3 serves
        for key, body in chunks.items():
            s3.put_object(Bucket=bucket, Key=key, Body=body)
        assert operator.drop("ring", "c1").copies == []
        restored = restore(node_y, s3_server, bucket, coordinator, [copy], unstage_kept)
        read = restored.memory_copy
        assert read is not None and not read.kept and read.chunks == 0, restored
        assert f"0 chunks from memory, {len(distinct)} from S3" in read.message, read
        assert the_same(unstage_kept, dumped)
    finally:
        node_y.stop()
        node_b.stop()

    # node-b gone: its copy is asked once, then S3
    restored = restore(node_x, s3_server, bucket, coordinator, [copy], unstage_kept)
    read = restored.memory_copy
    assert read is not None and not read.kept and "not reachable: node-b" in read.message, read
    assert the_same(unstage_kept, dumped)


def test_a_buddy_without_a_budget_leaves_the_part_in_s3_and_the_checkpoint_succeeds(
    dumped: dict[str, bytes],
    node_x: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
) -> None:
    bucket = "memtier-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    registered_shim(tmp_path / "state", sleeper.pid)
    node_b = holder(tmp_path, 0)
    try:
        report = checkpoint(node_x, s3_server, bucket, coordinator, node_b)
        assert node_b.client().info().node == "node-b"
    finally:
        node_b.stop()
    assert (report.state, report.phase) == ("Succeeded", "Succeeded"), report
    kept = report.memory_copy
    assert kept is not None and not kept.kept, report
    assert (kept.node, kept.part) == ("node-b", "node-x")
    assert "node node-b keeps no memory tier (its budget is 0)" in kept.message, kept
    store, manifest = commit(s3_server, bucket)
    store.restore(manifest.ref, tmp_path / "back")
    assert the_same(tmp_path / "back" / "node-x" / TREE, dumped)


# -- who may call ------------------------------------------------------------------------------------------


def test_the_agents_token_is_refused_on_sessions_and_the_operators_memory_calls_are_fenced(
    tmp_path: Path,
) -> None:
    node_b = holder(tmp_path, 1024 * 1024)
    try:
        agents = {"Authorization": "Bearer agent-token"}
        for method, path in (("POST", "/v1/sessions/checkpoint"), ("GET", "/v1/sessions/s1"),
                             ("GET", "/v1/containers")):  # fmt: skip
            status, _, body = node_b.raw(method, path, agents, b"{}" if method == "POST" else b"")
            assert status == 403 and b"may not use the node agent" in body, (path, body)
        # an operator leads this node at epoch 5; one deposed (epoch 4) may not drop copies
        leading: LeaderEpoch = (5, 1)
        deposed: LeaderEpoch = (4, 1)
        operator = {"Authorization": "Bearer op-token"}
        status, _, _ = node_b.raw("GET", COPIES, {**operator, LEADER_EPOCH_HEADER: format_epoch(leading)})
        assert status == 200
        status, _, body = node_b.raw(
            "DELETE", copy_path("ns/ring", "c1"), {**operator, LEADER_EPOCH_HEADER: format_epoch(deposed)}
        )
        assert status == 409 and b"was deposed" in body, body
        status, _, body = node_b.raw("GET", COPIES, operator)  # and one that does not elect, neither
        assert status == 409, body
        # the agents send no epoch: their calls are not the leader's to fence
        status, _, body = node_b.raw("PUT", copy_path("ns/ring", "c1", "node-x") + "/pieces/0", agents, b"x")
        assert status == 204, body
        status, _, body = node_b.raw("GET", COPIES, agents)
        assert status == 200 and b'"sealed":false' in body.replace(b" ", b""), body
    finally:
        node_b.stop()
