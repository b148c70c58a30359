"""A CheckpointJob's spec.compression reaches the store through the node agent: a whole checkpoint session
over the agent API on the host (real server, registry, coordinator, driver and SeaweedFS; the shim a fake
control socket, CRIU a stand-in that writes a compressible pages file), then the operator's commit. `none`
stores each chunk as its plain bytes behind the chunk header and the manifest says so; `zstd` stores it
smaller, at the store's level."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from agent.agent_harness import IMAGE_KEYS, Running
from agent.test_agent_disk import SECRET, agent_options, location, secret_data, wait_finished
from agent.test_agent_session import checkpoint_request, registered_shim

from ibckpt.agentapi import ImageDestination, Mode
from ibckpt.api import CompressionCodec
from ibckpt.api.storage import S3Location
from ibckpt.store import CheckpointRef, ImageStore
from ibckpt.store.codec import HEADER_SIZE, Codec, seal
from ibckpt_node.agent.staging import store_config
from testbed.coordinator import ThreadedCoordinator
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3


def compressible_pages(size: int = 2 * 1024 * 1024) -> bytes:
    """Text-like records, as a solver's log buffers would be: zstd shrinks them many times over. Larger
    than the store's pack threshold, so the file is one chunk of its own."""
    lines = b"".join(b"rank 0 step %08d residual 1.25e-06 ok\n" % step for step in range(size // 38 + 1))
    return lines[:size]


@pytest.fixture
def criu_writing_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A PATH whose criu 'dumps' by copying one pages file into its -D directory; returns its bytes."""
    pages = compressible_pages()
    source = tmp_path / "pages.src"
    source.write_bytes(pages)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    criu = bin_dir / "criu"
    criu.write_text(
        f"#!{sys.executable}\n"
        "import shutil, sys\n"
        "args = sys.argv[1:]\n"
        "if args[:1] == ['dump']:\n"
        f"    shutil.copyfile({str(source)!r}, args[args.index('-D') + 1] + '/pages-1.img')\n"
    )
    criu.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return pages


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_sessions_upload_stores_chunks_as_the_job_asked(
    codec: CompressionCodec,
    criu_writing_pages: bytes,
    agent: Running,
    tmp_path: Path,
    coordinator: ThreadedCoordinator,
    sleeper: subprocess.Popen[bytes],
    s3_server: S3Server,
) -> None:
    pages = criu_writing_pages
    bucket = "compress-" + secrets.token_hex(6)  # a bucket of its own: no chunk is there from before
    s3_server.create_bucket(bucket)
    agent_options(agent, s3_server)
    registered_shim(tmp_path / "state", sleeper.pid)
    session, tokens = coordinator.create_session({"node-x"})
    destination = ImageDestination(
        location=location(s3_server, bucket),
        credentials=SECRET,
        job="ring",
        checkpoint_id="c1",
        compression=codec,
    )
    request = checkpoint_request(coordinator, session, tokens["node-x"], Mode.STOP)
    client = agent.client()
    client.checkpoint(request.model_copy(update={"images": destination}))
    report = wait_finished(client, session)
    assert (report.state, report.phase) == ("Succeeded", "Stopped"), report

    config = store_config(destination.location, SECRET, secret_data(s3_server))
    store = ImageStore.open(config, signing=IMAGE_KEYS)
    manifest = store.commit_parts("ring", "c1", ["node-x"])
    assert (manifest.compression.codec, manifest.compression.level) == (codec, 0 if codec == "none" else 3)
    [record] = [r for r in manifest.files if r.path.endswith("/pages-1.img")]
    [chunk] = record.chunks
    assert chunk.size == len(pages)
    key = store.context.layout.chunk_key(chunk.id)
    stored = store.client.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(stored) == chunk.stored_size
    if codec == "none":
        # the header, then the plain bytes as they were dumped
        assert stored == seal(pages, Codec.RAW, len(pages), chunk.id, None)
    else:
        assert stored[:HEADER_SIZE] == seal(b"", Codec.ZSTD, len(pages), chunk.id, None)
        assert len(stored) < len(pages) // 10
    back = tmp_path / "back"
    store.restore(CheckpointRef("ring", "c1"), back)
    assert (back / record.path).read_bytes() == pages


def test_only_a_job_without_zstd_sends_the_field_an_older_agent_would_refuse() -> None:
    """docs/upgrade.md: an agent from before `images.compression` still takes every zstd job."""
    where = S3Location.model_validate(
        {"endpoint": "http://127.0.0.1:9", "bucket": "team", "credentialsSecretRef": {"name": SECRET.name}}
    )
    plain = ImageDestination(location=where, credentials=SECRET, job="j", checkpoint_id="c")
    assert "compression" not in plain.to_wire() and plain.codec == "zstd"
    off = plain.model_copy(update={"compression": "none"})
    assert off.to_wire()["compression"] == "none" and off.codec == "none"
    assert ImageDestination.from_wire(off.to_wire()).codec == "none"
