"""The node agent uploads a dump's pages while CRIU writes them: a whole checkpoint session over the agent
API on the host (as test_agent_compression.py), whose stand-in criu writes a pages file of several chunks
slowly and, before it exits, counts the chunks in the bucket. With pre-upload on, they are there before
criu has exited and the upload after the dump skips them; with it off (the agent's --no-pre-upload),
none is, and the upload stores them all. Either way the committed checkpoint restores the same bytes."""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import subprocess
from pathlib import Path

import pytest
from agent.agent_harness import IMAGE_KEYS, Running, stand_in_criu
from agent.test_agent_disk import SECRET, agent_options, location, secret_data, wait_finished
from agent.test_agent_session import checkpoint_request, registered_shim

from ibckpt.agentapi import ImageDestination, Mode, SessionReport
from ibckpt.store import CheckpointRef, ImageStore, Manifest
from ibckpt.store.config import DEFAULT_CHUNK_SIZE
from ibckpt.store.layout import Layout
from ibckpt_node.agent.staging import store_config
from testbed.coordinator import ThreadedCoordinator
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

CHUNKS = 4
CHUNKS_PREFIX = Layout("lab").chunks  # the location's prefix (test_agent_disk.location)


def slow_criu(tmp_path: Path, s3: S3Server, bucket: str) -> tuple[bytes, Path]:
    """A criu that 'dumps' a pages file of CHUNKS whole chunks and a tail, one chunk per 0.4 s, then
    waits (up to 10 s) for that many chunks to be in the bucket and writes how many it saw."""
    pages = os.urandom(CHUNKS * DEFAULT_CHUNK_SIZE + 123_456)
    source = tmp_path / "pages.src"
    source.write_bytes(pages)
    seen = tmp_path / "seen-before-exit"
    stand_in_criu(
        tmp_path,
        "import sys, time, boto3\n"
        "args = sys.argv[1:]\n"
        "if args[:1] != ['dump']:\n"
        "    sys.exit(0)\n"
        f"data = open({str(source)!r}, 'rb').read()\n"
        "with open(args[args.index('-D') + 1] + '/pages-1.img', 'wb') as out:\n"
        "    for at in range(0, len(data), 1 << 20):\n"
        "        out.write(data[at:at + (1 << 20)]); out.flush(); time.sleep(0.05)\n"
        f"s3 = boto3.client('s3', endpoint_url={s3.endpoint!r}, region_name={s3.region!r},\n"
        f"    aws_access_key_id={s3.access_key!r}, aws_secret_access_key={s3.secret_key!r})\n"
        "deadline = time.monotonic() + 10\n"
        "while True:\n"
        f"    listed = s3.list_objects_v2(Bucket={bucket!r}, Prefix={CHUNKS_PREFIX!r})\n"
        "    count = listed.get('KeyCount', 0)\n"
        f"    if count >= {CHUNKS} or time.monotonic() > deadline:\n"
        "        break\n"
        "    time.sleep(0.2)\n"
        f"open({str(seen)!r}, 'w').write(str(count))\n",
    )
    return pages, seen


def checkpoint_to(
    agent: Running,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
    bucket: str,
    mode: Mode,
    tmp_path: Path,
    timeout_s: float,
) -> SessionReport:
    """One node's checkpoint session of `sleeper` as job ring, checkpoint c1, staged to `bucket`."""
    registered_shim(tmp_path / "state", sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    request = checkpoint_request(coordinator, session, tokens["node-x"], mode)
    client = agent.client()
    client.checkpoint(request.model_copy(update={"images": destination(s3_server, bucket)}))
    return wait_finished(client, session, timeout_s=timeout_s)


def destination(s3_server: S3Server, bucket: str) -> ImageDestination:
    return ImageDestination(
        location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"
    )


def committed(s3_server: S3Server, bucket: str) -> tuple[ImageStore, Manifest]:
    """ring/c1 committed from node-x's part, as the operator does."""
    config = store_config(destination(s3_server, bucket).location, SECRET, secret_data(s3_server))
    store = ImageStore.open(config, signing=IMAGE_KEYS)
    return store, store.commit_parts("ring", "c1", ["node-x"])


def restored_pages(store: ImageStore, manifest: Manifest, tmp_path: Path) -> bytes:
    [record] = [r for r in manifest.files if r.path.endswith("/pages-1.img")]
    back = tmp_path / "back"
    store.restore(CheckpointRef("ring", "c1"), back)
    return (back / record.path).read_bytes()


@pytest.mark.parametrize(
    ("pre_upload", "mode"),
    [(True, Mode.STOP), (True, Mode.HOLD), (False, Mode.STOP), (True, Mode.LEAVE_RUNNING)],
    ids=["on", "on-hold", "off", "on-but-leave-running"],
)
def test_the_dumps_chunks_are_stored_before_criu_exits(
    pre_upload: bool,
    mode: Mode,
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = "preupload-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    pages, seen = slow_criu(tmp_path, s3_server, bucket)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    agent_options(agent, s3_server)
    sessions = agent.server.sessions
    sessions.agent = dataclasses.replace(sessions.agent, pre_upload=pre_upload)
    report = checkpoint_to(agent, coordinator, sleeper, s3_server, bucket, mode, tmp_path, timeout_s=120)
    ended = {Mode.STOP: "Stopped", Mode.HOLD: "Held"}.get(mode, "Succeeded")
    assert (report.state, report.phase) == ("Succeeded", ended), report

    during = int(seen.read_text())  # chunks in the bucket before criu exited
    store, manifest = committed(s3_server, bucket)
    if pre_upload and mode != Mode.LEAVE_RUNNING:  # a Hold is how the operator runs a Stop job
        assert during == CHUNKS
        assert f"; {CHUNKS} chunks were uploaded during the dump" in report.message
        # the upload after the dump stored only what the follower could not: the packed small files
        assert manifest.stats.uploaded_chunks == manifest.stats.distinct_chunks - CHUNKS
    else:  # off, or a LeaveRunning whose frozen ranks must not share the CPU with a follower
        assert during == 0
        assert "during the dump" not in report.message
        assert manifest.stats.uploaded_chunks == manifest.stats.distinct_chunks
    assert restored_pages(store, manifest, tmp_path) == pages


WINDOW_CHUNKS = 2


def criu_writing_faster_than_the_upload(tmp_path: Path, chunks: int) -> tuple[bytes, Path]:
    """A criu that writes a pages file of `chunks` whole chunks and a tail at 100 MiB/s, faster than the
    upload, and notes the most the file ever took on the disk (its blocks: a released span takes none)."""
    pages = os.urandom(chunks * DEFAULT_CHUNK_SIZE + 123_456)
    source = tmp_path / "pages.src"
    source.write_bytes(pages)
    peak = tmp_path / "peak-on-disk"
    stand_in_criu(
        tmp_path,
        "import os, sys, time\n"
        "args = sys.argv[1:]\n"
        "if args[:1] != ['dump']:\n"
        "    sys.exit(0)\n"
        f"data = open({str(source)!r}, 'rb').read()\n"
        "most = 0\n"
        "with open(args[args.index('-D') + 1] + '/pages-1.img', 'wb') as out:\n"
        "    for at in range(0, len(data), 1 << 20):\n"
        "        out.write(data[at:at + (1 << 20)]); out.flush(); time.sleep(0.01)\n"
        "        most = max(most, os.fstat(out.fileno()).st_blocks * 512)\n"
        f"open({str(peak)!r}, 'w').write(str(most))\n",
    )
    return pages, peak


@pytest.mark.parametrize("window", [True, False], ids=["window", "no-window"])
def test_a_disk_window_keeps_a_stop_dump_to_the_uploads_pace_and_the_checkpoint_whole(
    window: bool,
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the agent's disk window, a dump that writes 8 chunks at once holds at most about the window on
    the disk: its page spans leave the disk once stored, and CRIU is paused until they have. The committed
    checkpoint restores the same bytes, and the report says what left the disk."""
    chunks = 8
    bucket = "window-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    pages, peak = criu_writing_faster_than_the_upload(tmp_path, chunks)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    agent_options(agent, s3_server)
    sessions = agent.server.sessions
    window_bytes = WINDOW_CHUNKS * DEFAULT_CHUNK_SIZE if window else 0
    sessions.agent = dataclasses.replace(sessions.agent, disk_window_bytes=window_bytes)
    report = checkpoint_to(agent, coordinator, sleeper, s3_server, bucket, Mode.STOP, tmp_path, timeout_s=180)
    assert (report.state, report.phase) == ("Succeeded", "Stopped"), report

    most = int(peak.read_text())
    if window:
        # the window, plus what CRIU writes between two looks and the span being uploaded
        assert most <= window_bytes + 2 * DEFAULT_CHUNK_SIZE, (most, report.message)
        said = re.search(
            r"; (\d+) bytes left the disk once uploaded, the images held at most (\d+) \(window (\d+)\)",
            report.message,
        )
        assert said, report.message
        released, held, told = map(int, said.groups())
        # all but the spans still on their way when the dump ended; the agent's own look agrees
        assert released >= (chunks - 2) * DEFAULT_CHUNK_SIZE, report.message
        assert held <= window_bytes + 2 * DEFAULT_CHUNK_SIZE and told == window_bytes, report.message
    else:
        assert most >= chunks * DEFAULT_CHUNK_SIZE  # the whole file, until the upload
        assert "left the disk" not in report.message
    store, manifest = committed(s3_server, bucket)
    assert restored_pages(store, manifest, tmp_path) == pages
