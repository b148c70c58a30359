"""Fixtures for the image store tests: a fresh bucket per test on the session's SeaweedFS server."""

from __future__ import annotations

import contextlib
import filecmp
import io
import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from pydantic import SecretStr

from ibckpt.cli import main as cli_main
from ibckpt.store import Credentials, ImageStore, StoreConfig
from ibckpt.store.manifest import ChunkRef, Compression, Encryption, FileRecord, Manifest, Stats
from testbed.s3 import S3Server

StoreFactory = Callable[..., ImageStore]


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = "store-" + secrets.token_hex(6)
    s3_server.client().create_bucket(Bucket=name)
    return name


def config_for(s3_server: S3Server, **overrides: Any) -> StoreConfig:
    fields: dict[str, Any] = {
        "endpoint_url": s3_server.endpoint,
        "region": s3_server.region,
        "addressing_style": "path",
        "credentials": Credentials(
            access_key_id=SecretStr(s3_server.access_key),
            secret_access_key=SecretStr(s3_server.secret_key),
            source="the test fixture",
        ),
        "chunk_size": 256 * 1024,
        "workers": 4,
        "max_attempts": 2,
        "connect_timeout": 5.0,
        "read_timeout": 20.0,
    }
    fields.update(overrides)
    return StoreConfig.model_validate(fields)


@pytest.fixture
def make_store(s3_server: S3Server, bucket: str) -> StoreFactory:
    """ImageStore on this test's bucket; keyword arguments override StoreConfig fields."""

    def make(**overrides: Any) -> ImageStore:
        return ImageStore.open(config_for(s3_server, **({"bucket": bucket} | overrides)))

    return make


@pytest.fixture
def s3_env(s3_server: S3Server, bucket: str) -> dict[str, str]:
    """Environment for running the `ibckpt` CLI against this test's bucket."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "IBCKPT_"))}
    env.update(
        IBCKPT_S3_ENDPOINT=s3_server.endpoint,
        IBCKPT_S3_BUCKET=bucket,
        IBCKPT_S3_REGION=s3_server.region,
        IBCKPT_S3_ADDRESSING="path",
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
        IBCKPT_CHUNK_SIZE="256KiB",
        IBCKPT_WORKERS="4",
    )
    return env


def sample_manifest(**changes: object) -> Manifest:
    """A small valid manifest of checkpoint ns/solver c1; a test changes the fields it is about."""
    chunk = ChunkRef(id="ab" * 32, size=10, stored_size=30)
    fields: dict[str, object] = {
        "job": "ns/solver",
        "checkpoint_id": "c1",
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
        "started_at": datetime(2026, 1, 1, tzinfo=UTC),
        "compression": Compression(codec="zstd", level=3, chunk_size=1024),
        "encryption": Encryption(mode="none"),
        "files": [
            FileRecord(path="d", kind="dir", mode=0o755),
            FileRecord(path="d/pages.img", kind="file", mode=0o600, size=20, chunks=[chunk, chunk]),
        ],
        "stats": Stats(),
    }
    fields.update(changes)
    return Manifest.model_validate(fields)


def write_tree(root: Path, files: dict[str, bytes], modes: dict[str, int] | None = None) -> Path:
    """Create files (parents included) under root; modes by relative path."""
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for relative, mode in (modes or {}).items():
        os.chmod(root / relative, mode)
    return root


def compressible(size: int, seed: int = 0) -> bytes:
    line = f"rank {seed} step {{}} residual 0.000{seed}1 converged false\n"
    text = "".join(line.format(step) for step in range(size // 40 + 1)).encode()
    return text[:size]


def assert_same_tree(left: Path, right: Path) -> None:
    """Same names, kinds, link targets, modes, contents and file mtimes."""
    names_left = sorted(str(p.relative_to(left)) for p in left.rglob("*"))
    names_right = sorted(str(p.relative_to(right)) for p in right.rglob("*"))
    assert names_left == names_right
    for name in names_left:
        a, b = left / name, right / name
        sa, sb = os.lstat(a), os.lstat(b)
        assert stat.S_IFMT(sa.st_mode) == stat.S_IFMT(sb.st_mode), name
        if stat.S_ISLNK(sa.st_mode):
            assert os.readlink(a) == os.readlink(b), name
            continue
        assert stat.S_IMODE(sa.st_mode) == stat.S_IMODE(sb.st_mode), name
        if stat.S_ISREG(sa.st_mode):
            assert filecmp.cmp(a, b, shallow=False), name
            assert sa.st_mtime_ns == sb.st_mtime_ns, name


class Requests:
    """The S3 operations a client sends, with their keys (botocore event hooks)."""

    def __init__(self, client: Any) -> None:
        self.sent: list[tuple[str, str]] = []
        client.meta.events.register("before-parameter-build.s3", self._seen)

    def _seen(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        self.sent.append((model.name, str(params.get("Key", params.get("Prefix", "")))))

    def named(self, operation: str, area: str = "") -> list[str]:
        """Keys of the `operation` requests, under `area` (chunks, manifests, leases...) if given."""
        return [key for name, key in self.sent if name == operation and f"/v1/{area}" in key]

    def count(self) -> int:
        return len(self.sent)


@pytest.fixture
def tree_factory(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    counter = iter(range(1_000_000))

    def make(files: dict[str, bytes], modes: dict[str, int] | None = None) -> Path:
        return write_tree(tmp_path / f"tree-{next(counter)}", files, modes)

    yield make


def chunk_keys(s3_server: S3Server, bucket: str) -> list[str]:
    s3 = s3_server.client()
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="ibckpt/v1/chunks/"):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return keys


@pytest.fixture
def list_chunks(s3_server: S3Server, bucket: str) -> Callable[[], list[str]]:
    return lambda: chunk_keys(s3_server, bucket)


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_cli(env: dict[str, str], *args: str, check: bool = True, in_process: bool = True) -> CliResult:
    """`ibckpt images ARGS` with exactly `env` as its environment. In-process by default (the same main() the
    console script calls, minus a second of interpreter start-up); in_process=False runs a real subprocess."""
    argv = ["images", *args]
    if in_process:
        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(argv)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        result = CliResult(code, out.getvalue(), err.getvalue())
    else:
        done = subprocess.run(
            [sys.executable, "-m", "ibckpt.cli", *argv], env=env, capture_output=True, text=True, timeout=120
        )
        result = CliResult(done.returncode, done.stdout, done.stderr)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def ibckpt() -> Callable[..., CliResult]:
    return run_cli


@pytest.fixture
def ibckpt_json() -> Callable[..., Any]:
    return lambda env, *args: json.loads(run_cli(env, *args, "-o", "json").stdout)


@pytest.fixture
def helpers() -> Any:
    """Plain helper functions (conftest modules cannot be imported by the tests under importlib mode)."""

    class Helpers:
        write_tree = staticmethod(write_tree)
        compressible = staticmethod(compressible)
        assert_same_tree = staticmethod(assert_same_tree)
        Requests = Requests

    return Helpers
