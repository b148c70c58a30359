"""What sessions leave on the node's disk, through the agent API on the host (real server, registry,
coordinator, driver and SeaweedFS; the rank's shim a fake control socket, CRIU a stand-in that exits 0):
staged images are removed, images that were not staged stay for a bounded time and say so, the sweep
at start removes what outlived its bound but never a session's recovery record, a failed restore
leaves no staging, and a checkpoint or a restore that would not fit on the disk is refused untouched."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from agent.agent_harness import IMAGE_KEYS, Running
from agent.test_agent_session import checkpoint_request, registered_shim
from pydantic import SecretStr

from ibckpt.agentapi import (
    AgentClient,
    ImageDestination,
    ImageSource,
    Mode,
    RestoreRank,
    RestoreRequest,
    SecretRef,
    SessionReport,
)
from ibckpt.api.storage import S3Location
from ibckpt.store import ImageStore
from ibckpt_node.agent import disk, recovery, restoring
from ibckpt_node.agent.main import parse
from ibckpt_node.agent.staging import stage_trees, store_config
from ibckpt_node.preflight import image_estimate
from ibckpt_node.trees import TREE_MANIFEST
from testbed.coordinator import ThreadedCoordinator
from testbed.s3 import S3Server

SECRET = SecretRef(namespace="ibckpt", name="s3-credentials")
HOUR = 3600.0


def secret_data(s3: S3Server) -> dict[str, str]:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {"AWS_ACCESS_KEY_ID": b64(s3.access_key), "AWS_SECRET_ACCESS_KEY": b64(s3.secret_key)}


def location(s3: S3Server, bucket: str) -> S3Location:
    return S3Location.model_validate(
        {
            "endpoint": s3.endpoint,
            "region": s3.region,
            "bucket": bucket,
            "prefix": "lab",
            "credentialsSecretRef": {"name": SECRET.name},
        }
    )


def agent_options(agent: Running, s3: S3Server | None = None, keep_s: float | None = None) -> None:
    """The running agent reads the Secret from `s3`, and keeps failed images `keep_s` seconds."""
    sessions = agent.server.sessions
    if s3 is not None:

        async def read(namespace: str, name: str) -> dict[str, str]:
            assert (namespace, name) == (SECRET.namespace, SECRET.name)
            return secret_data(s3)

        sessions.agent = dataclasses.replace(sessions.agent, secrets=read)
    if keep_s is not None:
        sessions.agent = dataclasses.replace(sessions.agent, keep_failed_images_s=keep_s)


def wait_finished(client: AgentClient, session: str, timeout_s: float = 60) -> SessionReport:
    """The report once the session's run is over, its clean-up included (finished_at is set last)."""
    deadline = time.monotonic() + timeout_s
    report = client.session(session)
    while (report.finished_at is None or not report.state.finished) and time.monotonic() < deadline:
        time.sleep(0.2)
        report = client.session(session)
    return report


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert check()


# -- a checkpoint's images ----------------------------------------------------------------------


@pytest.mark.usefixtures("fake_criu")
def test_staged_images_leave_the_node_and_the_held_sessions_record_stays_until_its_ranks_run(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
) -> None:
    state = tmp_path / "state"
    bucket = "disk-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    agent_options(agent, s3_server)
    shim = registered_shim(state, sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    request = checkpoint_request(coordinator, session, token, Mode.STOP).model_copy(
        update={
            "images": ImageDestination(
                location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"
            )
        }
    )
    client = agent.client()
    client.checkpoint(request)
    report = wait_finished(client, session)
    assert (report.state, report.phase) == ("Succeeded", "Stopped"), report
    assert report.message.startswith("staged "), report.message
    # the part is in the store: the images on the node are no longer needed, and are gone
    config = store_config(location(s3_server, bucket), SECRET, secret_data(s3_server))
    manifest = ImageStore.open(config, signing=IMAGE_KEYS).commit_parts("ring", "c1", ["node-x"])
    assert [r.root for r in manifest.ranks] == ["node-x/pod-c1.main"]
    where = state / "sessions" / session
    assert not (where / "images").exists()
    # the ranks wait released: the record a next agent would bring them back with stays
    assert shim.state == "released"
    assert sorted(p.name for p in where.iterdir()) == [recovery.RECORD]

    client.abort(session, "node-y: upload failed", (f"127.0.0.1:{coordinator.port}", token))
    assert wait_finished(client, session).state == "Aborted"
    assert shim.state == "running"
    wait_for(lambda: not where.exists())  # the record goes once the ranks run again, the empty dir too


def test_images_that_were_not_staged_stay_for_the_bound_and_say_so(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    fake_criu: None,
) -> None:
    state = tmp_path / "state"
    session, report = failed_upload(agent, state, coordinator, sleeper.pid)
    images = state / "sessions" / session / "images"
    assert report.state == "Failed", report
    assert report.message.endswith(f"(images kept in {images} for 6 h)"), report.message
    assert (images / "pod-c1.main" / TREE_MANIFEST).exists()
    marker = json.loads((images.parent / disk.KEPT).read_text())
    assert marker["why"] == "upload failed" and time.time() - marker["at"] < 60
    assert not recovery.record_path(state, session).exists()  # the rank runs: no record


def failed_upload(
    agent: Running, state: Path, coordinator: ThreadedCoordinator, pid: int
) -> tuple[str, SessionReport]:
    """A checkpoint of one registered rank whose upload fails after the dump: the harness's agent may
    not read Secrets, so staging raises a StagingError. The session id and its final report."""
    registered_shim(state, pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    location = S3Location.model_validate(
        {"bucket": "never-reached", "credentialsSecretRef": {"name": SECRET.name}}
    )
    destination = ImageDestination(location=location, credentials=SECRET, job="ring", checkpoint_id="c2")
    request = checkpoint_request(coordinator, session, token).model_copy(update={"images": destination})
    client = agent.client()
    client.checkpoint(request)
    return session, wait_finished(client, session)


def test_with_no_time_to_keep_them_images_that_were_not_staged_go_at_once(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    fake_criu: None,
) -> None:
    state = tmp_path / "state"
    agent_options(agent, keep_s=0)
    session, report = failed_upload(agent, state, coordinator, sleeper.pid)
    assert report.state == "Failed" and report.message.endswith("(images removed)"), report
    assert not (state / "sessions" / session).exists()


def test_the_option_sets_the_bound() -> None:
    base = ["--node", "n", "--address", "10.0.0.1", "--allow", "system:serviceaccount:a:b"]
    assert parse(base).keep_failed_images == disk.DEFAULT_KEEP_FAILED_S == 6 * HOUR
    assert parse([*base, "--keep-failed-images", "0"]).keep_failed_images == 0
    with pytest.raises(SystemExit):
        parse([*base, "--keep-failed-images", "-1"])


# -- the sweep ----------------------------------------------------------------------------------


def leftover(root: Path, name: str, size: int, age_s: float, marker: str | None = None) -> Path:
    """A session directory with `size` bytes of images `age_s` old (by their marker when `marker`
    says why they were kept, else by the directory's time)."""
    images = root / "sessions" / name / "images"
    (images / "pod.main").mkdir(parents=True)
    (images / "pod.main" / "pages-1.img").write_bytes(b"x" * size)
    then = time.time() - age_s
    if marker is not None:
        disk.keep(root, name, marker, now=then)
    os.utime(images, (then, then))
    return images.parent


def staging(root: Path, pod: str, age_s: float) -> Path:
    where = root / "restore" / "team" / pod / "main"
    (where / "images").mkdir(parents=True)
    (where / "images" / "pages-1.img").write_bytes(b"y" * 300)
    (where / "staged.json").write_text("{}\n")
    then = time.time() - age_s
    os.utime(where, (then, then))
    return where


def test_the_sweep_at_start_removes_what_outlived_its_bound_and_keeps_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    old_failed = leftover(state, "ckj-old-failed", 1000, 7 * HOUR, disk.UPLOAD_FAILED)
    young_failed = leftover(state, "ckj-young-failed", 10, 1 * HOUR, disk.UPLOAD_FAILED)
    unmarked = leftover(state, "ckj-crashed", 2000, 7 * HOUR)  # an agent died mid-session
    result = leftover(state, "ckj-result", 10, 30 * 24 * HOUR, disk.RESULT)
    held = leftover(state, "ckj-held", 500, 7 * HOUR)
    (held / recovery.RECORD).write_text("{}")  # its ranks may still wait for a recovery
    (state / "sessions" / "ckj-empty").mkdir()
    old_staging = staging(state, "ring-0", 7 * HOUR)
    young_staging = staging(state, "ring-1", 1 * HOUR)
    (state / disk.TRASH / "images-0123").mkdir(parents=True)  # an earlier agent died while removing
    (state / disk.TRASH / "images-0123" / "f").write_bytes(b"z" * 7)

    with caplog.at_level(logging.INFO, logger="ibckpt_node.agent.disk"):
        running = Running(state)
        try:
            wait_for(lambda: len([r for r in caplog.records if "bytes freed" in r.getMessage()]) == 5)
        finally:
            running.stop()
    lines = sorted(r.getMessage() for r in caplog.records if "bytes freed" in r.getMessage())
    assert lines == sorted(
        [
            "removed images of session ckj-old-failed (upload failed, 7 h old): 1000 bytes freed",
            "removed images of session ckj-crashed (left by an earlier agent, 7 h old): 2000 bytes freed",
            "removed images of session ckj-held (left by an earlier agent, 7 h old): 500 bytes freed",
            f"removed restore staging {old_staging} (no restore runs, 7 h old): 303 bytes freed",
            f"removed images-0123 (left in {state / disk.TRASH}): 7 bytes freed",
        ]
    ), lines
    assert not old_failed.exists() and not unmarked.exists()
    assert not (state / "sessions" / "ckj-empty").exists()
    assert sorted(p.name for p in held.iterdir()) == [recovery.RECORD]  # the record stays
    assert (young_failed / "images").exists() and (young_failed / disk.KEPT).exists()
    assert (result / "images").exists()
    assert not old_staging.exists() and not old_staging.parent.exists()
    assert (young_staging / "staged.json").exists()
    assert list((state / disk.TRASH).iterdir()) == []


def test_the_sweep_leaves_a_running_sessions_images_and_a_running_restores_staging(tmp_path: Path) -> None:
    state = tmp_path / "state"
    leftover(state, "ckj-running", 10, 7 * HOUR)
    leftover(state, "ckj-other", 10, 7 * HOUR, "failed")
    staging(state, "ring-0", 7 * HOUR)
    found = disk.expired(state, state / "restore", HOUR, busy={"ckj-running"}, restoring=True)
    assert [item.path for item in found] == [state / "sessions" / "ckj-other" / "images"]
    everything = disk.expired(state, state / "restore", 0)
    assert len(everything) == 3


# -- a restore that fails removes its staging ---------------------------------------------------


def restore_of(
    s3: S3Server, tmp_path: Path, checkpoint_id: str, manifests: dict[str, bool]
) -> RestoreRequest:
    """A restore of `checkpoint_id`, committed first: one 4000-byte pages image per pod of `manifests`, and
    a tree manifest for those marked True."""
    bucket = "disk-" + secrets.token_hex(6)
    s3.create_bucket(bucket)
    dumped = tmp_path / "dumped"
    for pod, with_manifest in manifests.items():
        (dumped / f"{pod}.main").mkdir(parents=True)
        (dumped / f"{pod}.main" / "pages-1.img").write_bytes(os.urandom(4000))
        if with_manifest:
            manifest = json.dumps({"runtime": "runc", "restore_args": ""})
            (dumped / f"{pod}.main" / TREE_MANIFEST).write_text(manifest)
    destination = ImageDestination(
        location=location(s3, bucket), credentials=SECRET, job="ring", checkpoint_id=checkpoint_id
    )
    config = store_config(destination.location, SECRET, secret_data(s3))
    trees = [(f"{pod}.main", pod) for pod in manifests]
    stage_trees(config, destination, "node-1", dumped, trees, lambda n: None, IMAGE_KEYS)
    ImageStore.open(config, signing=IMAGE_KEYS).commit_parts("ring", checkpoint_id, ["node-1"])
    return RestoreRequest(
        session_id=f"rsj-{checkpoint_id}",
        coordinator="127.0.0.1:9",  # never reached: the download fails first
        session_token=SecretStr("t"),
        job="ring",
        checkpoint=f"team/{checkpoint_id}",
        images=ImageSource(
            location=destination.location, credentials=SECRET, job="ring", checkpoint_id=checkpoint_id
        ),
        ranks=[
            RestoreRank(container="main", rank_key=f"ring/{pod}/main/1", namespace="team", pod=pod)
            for pod in manifests
        ],
    )


def test_a_restore_whose_download_fails_midway_leaves_no_staging(
    agent: Running, tmp_path: Path, s3_server: S3Server
) -> None:
    """ring-0's tree is staged, then ring-1's is refused (no tree manifest): the session fails, and what
    it had staged is gone."""
    state = tmp_path / "state"
    request = restore_of(s3_server, tmp_path, "c4", {"ring-0": True, "ring-1": False})
    agent_options(agent, s3_server)
    client = agent.client()
    client.restore(request)
    report = wait_finished(client, "rsj-c4")
    assert report.state == "Failed" and "no tree manifest" in report.message, report
    # Both trees were fetched before ring-1's was refused: the report counted every byte of them, the
    # progress the operator creates the pods by (machine/restore.py, "Overlap").
    tree = len(json.dumps({"runtime": "runc", "restore_args": ""}))
    assert report.staging is not None, report
    assert report.staging.bytes_planned == report.staging.bytes_done == 4000 + tree + 4000, report.staging
    assert report.staging.seconds > 0
    assert not (state / "restore" / "team").exists(), list((state / "restore").rglob("*"))


def test_a_restore_that_would_not_fit_on_the_disk_is_refused_before_it_stages_anything(
    agent: Running, tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    request = restore_of(s3_server, tmp_path, "c6", {"ring-0": True})
    agent_options(agent, s3_server)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=0, free=1 << 20)
    )
    client = agent.client()
    client.restore(request)
    report = wait_finished(client, "rsj-c6")
    assert report.state == "Refused", report
    size = sum(f.stat().st_size for f in (tmp_path / "dumped" / "ring-0.main").iterdir())  # ~3.9 KiB
    assert report.message == (
        f"refusing to restore on this node: its images would need about 64.0 MiB ({image_estimate(size)} "
        f"bytes: {size / 1024:.1f} KiB in the files of 1 container, plus 10% and 64 MiB) and {state} has "
        "1.0 MiB (1048576 bytes) free: free space there or give agent.hostDir a larger disk "
        "(docs/node-agent.md)"
    ), report.message
    assert [r.phase for r in report.ranks] == ["Failed"], report
    assert not (state / "restore" / "team").exists(), list((state / "restore").rglob("*"))


def test_a_download_that_goes_on_after_its_session_ended_stages_nothing(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A download past its bound, or aborted, runs on in its thread: once the session has ended (`stop`),
    what it fetches is removed and no staged.json appears for the runtime to restore from."""
    bucket = "disk-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    tree = tmp_path / "dumped" / "ring-0.main"
    tree.mkdir(parents=True)
    (tree / "pages-1.img").write_bytes(os.urandom(4000))
    (tree / TREE_MANIFEST).write_text(json.dumps({"runtime": "runc", "restore_args": ""}))
    destination = ImageDestination(
        location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id="c5"
    )
    config = store_config(destination.location, SECRET, secret_data(s3_server))
    stage_trees(
        config, destination, "node-1", tree.parent, [("ring-0.main", "ring-0")], lambda n: None, IMAGE_KEYS
    )
    ImageStore.open(config, signing=IMAGE_KEYS).commit_parts("ring", "c5", ["node-1"])
    source = ImageSource(location=destination.location, credentials=SECRET, job="ring", checkpoint_id="c5")
    planned = [restoring.ContainerRestore("", "team", "ring-0", "main", "node-1/ring-0.main", ("k",))]
    root = tmp_path / "restore"
    stop = threading.Event()

    def ended(size: int) -> None:  # the session ends while the bytes come
        stop.set()

    restoring.stage(
        config, source, "team/c5", planned, lambda ns, pod, c: str(root / ns / pod / c), ended, stop=stop,
        keys=IMAGE_KEYS,
    )  # fmt: skip
    assert stop.is_set()
    assert list(root.rglob("*")) == []


# -- a checkpoint that would not fit ------------------------------------------------------------


def test_a_checkpoint_that_would_not_fit_on_the_disk_is_refused_and_its_rank_untouched(
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=0, free=1 << 20)
    )
    monkeypatch.setenv("PATH", "/nonexistent")  # no CRIU reaches the process, whatever happens
    shim = registered_shim(tmp_path / "state", sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    token = tokens["node-x"]
    client = agent.client()
    client.checkpoint(checkpoint_request(coordinator, session, token))
    report = wait_finished(client, session)
    assert report.state == "Refused", report
    assert report.message.startswith("node-x: refusing to checkpoint on this node: its images would need")
    assert f"{tmp_path / 'state' / 'sessions' / session} has 1.0 MiB (1048576 bytes) free" in report.message
    # read-only: the device list the checkpoint records (rdma_devices.record), then the preflight's
    assert shim.commands == ["status", "status"]
    assert [r.phase for r in report.ranks] == ["Resumed"], report  # never stopped: not a failed resume
    assert not (tmp_path / "state" / "sessions" / session).exists()
