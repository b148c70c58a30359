"""The `ibckpt images` command line, configured through the environment as users run it: machine-readable
output, exit codes, and an upload process killed halfway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.s3

LEASE_SECONDS = 6


def test_upload_inspect_verify_download_remove(
    s3_env: dict[str, str], tree_factory: Any, tmp_path: Path, ibckpt: Any, ibckpt_json: Any
) -> None:
    tree = tree_factory(
        {"pages-1.img": os.urandom(700_000), "core-1.img": b"core" * 100}, modes={"core-1.img": 0o600}
    )
    uploaded = ibckpt_json(
        s3_env,
        "upload",
        str(tree),
        "--job",
        "ns/solver",
        "--id",
        "ckpt-1",
        "--node",
        "node-a",
        "--label",
        "k=v",
    )
    assert uploaded["checkpoint"] == "ns/solver/ckpt-1"
    # two full chunks of pages-1.img, and one pack: its tail and core-1.img
    assert uploaded["stats"]["logical_bytes"] == 700_400 and uploaded["stats"]["uploaded_chunks"] == 3

    listed = ibckpt_json(s3_env, "ls")
    assert [(row["job"], row["checkpoint_id"], row["logical_bytes"]) for row in listed] == [
        ("ns/solver", "ckpt-1", 700_400)
    ]
    text = ibckpt(s3_env, "ls").stdout
    assert "ns/solver" in text and "ckpt-1" in text

    manifest = ibckpt_json(s3_env, "show", "ns/solver/latest")
    assert manifest["schema_version"] == 2 and manifest["labels"] == {"k": "v"}
    assert manifest["ranks"] == [{"rank": 0, "pod": None, "node": "node-a", "root": ""}]
    assert "checkpoint   ns/solver/ckpt-1" in ibckpt(s3_env, "show", "ns/solver/ckpt-1", "--files").stdout

    verified = ibckpt_json(s3_env, "verify", "ns/solver/ckpt-1")
    assert verified["ok"] and verified["chunks"] == 3 and verified["problems"] == []

    out = tmp_path / "restored"
    downloaded = ibckpt_json(s3_env, "download", "ns/solver/ckpt-1", str(out))
    assert downloaded["bytes"] == 700_400
    assert (out / "pages-1.img").read_bytes() == (tree / "pages-1.img").read_bytes()
    assert (out / "core-1.img").stat().st_mode & 0o777 == 0o600

    assert ibckpt_json(s3_env, "rm", "ns/solver/ckpt-1") == {"deleted": ["ns/solver/ckpt-1"]}
    assert ibckpt_json(s3_env, "ls") == []
    missing = ibckpt(s3_env, "show", "ns/solver/ckpt-1", check=False)
    assert missing.returncode == 1 and "checkpoint ns/solver/ckpt-1 does not exist" in missing.stderr
    gc = ibckpt_json(s3_env, "gc", "--grace", "0")
    assert gc["swept"] and gc["chunks_deleted"] == 3


def test_verify_exit_code_names_the_bad_chunk(
    s3_env: dict[str, str], make_store: Any, tree_factory: Any, ibckpt: Any
) -> None:
    store = make_store()
    manifest = store.upload_tree(tree_factory({"a.img": os.urandom(300_000)}), "solver", "c1")
    victim = manifest.files[0].chunks[0].id
    store.client.delete_object(Bucket=store.config.bucket, Key=store.context.layout.chunk_key(victim))
    result = ibckpt(s3_env, "verify", "solver/c1", check=False)
    assert result.returncode == 1
    assert f"chunk {victim} of checkpoint solver/c1 is missing" in result.stderr
    assert result.stdout.startswith("FAILED: 1 bad chunk(s)")


def test_killed_upload_leaves_no_checkpoint_and_gc_removes_its_chunks(
    s3_env: dict[str, str],
    make_store: Any,
    tree_factory: Any,
    list_chunks: Any,
    tmp_path: Path,
    ibckpt: Any,
    ibckpt_json: Any,
) -> None:
    tree = tree_factory({f"pages-{index:02}.img": os.urandom(256 * 1024) for index in range(24)})
    store = make_store()
    # Throttled so that the kill lands mid-upload; a short lease so that the test need not wait 10 minutes.
    command = [sys.executable, "-m", "ibckpt.cli", "images", "upload", str(tree), "--job", "solver"]
    throttle = ["--max-rate", "1MiB", "--lease", f"{LEASE_SECONDS}s", "--workers", "2", "--no-progress"]
    upload = subprocess.Popen(
        [*command, "--id", "killed", *throttle],
        env=s3_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list_chunks()) < 3:
            assert upload.poll() is None, "the upload finished before it could be killed"
            assert time.monotonic() < deadline, "no chunk appeared"
            time.sleep(0.05)
        upload.send_signal(signal.SIGKILL)
        assert upload.wait(timeout=30) == -signal.SIGKILL
    finally:
        if upload.poll() is None:
            upload.kill()
            upload.wait()
    killed_at = time.monotonic()
    orphans = len(list_chunks())
    assert 3 <= orphans < 24

    # While the dead writer's lease has not expired, the sweep defers and every orphan stays.
    early = ibckpt_json(s3_env, "gc", "--grace", "0")
    assert not early["swept"] and early["deferred_by"] == [next(iter(early["deferred_by"]))]
    assert "writer solver/killed" in early["deferred_by"][0]
    assert len(list_chunks()) == orphans

    # No manifest: for every reader, the checkpoint does not exist.
    assert store.checkpoints() == []
    assert ibckpt_json(s3_env, "ls") == []
    assert "does not exist" in ibckpt(s3_env, "show", "solver/killed", check=False).stderr

    # Once the lease has expired, the next collection removes the orphans and the dead lease.
    # (S3 timestamps may be whole seconds: allow for that, as the collector does.)
    time.sleep(max(0.0, killed_at + LEASE_SECONDS + 2.5 - time.monotonic()))
    late = ibckpt_json(s3_env, "gc", "--grace", "0")
    assert late["swept"] and late["chunks_deleted"] == orphans and late["stale_leases_removed"] == 1
    assert list_chunks() == []

    # A retry succeeds and restores byte for byte.
    retry = ibckpt_json(s3_env, "upload", str(tree), "--job", "solver", "--id", "killed")
    assert retry["stats"]["uploaded_chunks"] == 24
    out = tmp_path / "out"
    ibckpt(s3_env, "download", "solver/killed", str(out))
    for index in range(24):
        name = f"pages-{index:02}.img"
        assert (out / name).read_bytes() == (tree / name).read_bytes()


def test_credentials_from_a_mounted_secret(
    s3_env: dict[str, str], s3_server: Any, tmp_path: Path, ibckpt: Any, ibckpt_json: Any
) -> None:
    mounted = tmp_path / "secret"
    mounted.mkdir()
    (mounted / "AWS_ACCESS_KEY_ID").write_text(s3_server.access_key)
    (mounted / "AWS_SECRET_ACCESS_KEY").write_text(s3_server.secret_key + "\n")
    env = {key: value for key, value in s3_env.items() if not key.startswith("AWS_ACCESS_KEY_ID")}
    env.pop("AWS_SECRET_ACCESS_KEY")
    assert ibckpt_json(env, "ls", "--credentials-dir", str(mounted)) == []
    (mounted / "AWS_SECRET_ACCESS_KEY").write_text("not-the-secret")
    result = ibckpt(dict(env, IBCKPT_S3_CREDENTIALS_DIR=str(mounted)), "ls", check=False)
    assert result.returncode == 1 and f"credentials from Secret {mounted}" in result.stderr
    assert "not-the-secret" not in result.stderr


def test_two_nodes_stage_parts_and_one_commit_makes_the_checkpoint(
    s3_env: dict[str, str], tree_factory: Any, tmp_path: Path, ibckpt: Any, ibckpt_json: Any
) -> None:
    node_a = tree_factory({"pages-1.img": os.urandom(300_000)})
    node_b = tree_factory({"pages-1.img": os.urandom(200_000)})
    for part, tree, rank in (("node-a", node_a, 0), ("node-b", node_b, 1)):
        staged = ibckpt_json(
            s3_env, "stage", str(tree), "--job", "ns/ring", "--id", "c1", "--part", part,
            "--under", f"rank-{rank}", "--rank", str(rank),
        )  # fmt: skip
        assert staged["part"] == part
    # Staged parts are not a checkpoint yet; a commit that expects a missing part refuses.
    assert ibckpt_json(s3_env, "ls", "--job", "ns/ring") == []
    refused = ibckpt(s3_env, "commit", "ns/ring/c1", "--expect", "node-a,node-b,node-c", check=False)
    assert refused.returncode == 1 and "node-c" in refused.stderr
    committed = ibckpt_json(s3_env, "commit", "ns/ring/c1", "--expect", "node-a,node-b")
    assert committed["checkpoint"] == "ns/ring/c1" and committed["ranks"] == 2

    out = tmp_path / "both"
    ibckpt_json(s3_env, "download", "ns/ring/c1", str(out))
    assert (out / "rank-0" / "pages-1.img").read_bytes() == (node_a / "pages-1.img").read_bytes()
    assert (out / "rank-1" / "pages-1.img").read_bytes() == (node_b / "pages-1.img").read_bytes()
    manifest = ibckpt_json(s3_env, "show", "ns/ring/c1")
    assert sorted((r["rank"], r["node"], r["root"]) for r in manifest["ranks"]) == [
        (0, "node-a", "rank-0"),
        (1, "node-b", "rank-1"),
    ]
