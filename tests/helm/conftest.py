"""A team's namespace beside the session's release of the chart (the `installed` fixture of
tests/conftest.py, which tests/cluster starts so that the operator starts while they run)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

from testbed import pods, ring
from testbed.release import SESSION_RELEASE, STORAGE_SECRET, Release, sa_token, storage_secret
from testbed.ring import PRODUCT_NS
from testbed.s3 import S3Server

__all__ = ["STORAGE_SECRET", "Release", "sa_token"]

RELEASE = SESSION_RELEASE
NAMESPACE = PRODUCT_NS
OPERATOR_SA = f"{RELEASE}-operator"
AGENT_SA = f"{RELEASE}-agent"
AGENT_PORT = 9478
METRICS_PORT = 9479
JOB_NS = "team-ring"


@pytest.fixture
def job_ns(installed: Release, s3_server: S3Server) -> Iterator[str]:
    """A team's namespace with its storage: a CheckpointStorage `store` and its credentials Secret."""
    cluster = installed.cluster
    # A node lost by an earlier test fails this one at once, not after each of its waits runs out.
    dead = cluster.guests.dead()
    ready = cluster.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=120s", check=False)
    if dead or ready.returncode != 0:
        lost = f"testbed: a node is gone or not Ready before the test:\n{ready.stderr}"
        pytest.fail(lost + cluster.diagnose())
    pods.namespace(cluster, JOB_NS)
    bucket = f"ring-job-{secrets.token_hex(3)}"
    s3_server.create_bucket(bucket)
    storage_secret(cluster, JOB_NS, s3_server.access_key, s3_server.secret_key)
    pods.apply(cluster, JOB_NS, ring.storage(s3_server.endpoint, bucket))
    try:
        yield JOB_NS
    finally:
        pods.delete_namespace(cluster, JOB_NS)


HOST_DIR = "/var/lib/ibckpt"  # the chart's agent.hostDir
LEFT_ON_DISK = """
import os, sys
def bytes_of(path):
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0
def size(top, only=None):
    total = 0
    for root, dirs, files in os.walk(top):
        if "kept.json" in files:
            dirs.clear()
            continue
        if only is None or only in root.split(os.sep):
            total += sum(bytes_of(os.path.join(root, f)) for f in files)
    return total
print(size(sys.argv[1] + "/sessions", "images"), size(sys.argv[1] + "/restore"))
"""


def left_on_disk(installed: Release) -> dict[str, tuple[int, int]]:
    """Each node's (image bytes, restore staging bytes) under the agents' host dir (of running agents).
    An exec is tried again for 30 s: a fresh node's agent restarts containerd once it serves, and the
    kubelet answers no exec until containerd is back."""
    found = {}
    for agent in installed.agent_pods():
        if agent["status"].get("phase") != "Running":
            continue
        deadline = time.monotonic() + 30
        while True:
            done = installed.cluster.kubectl(
                "exec", "-n", installed.namespace, agent["metadata"]["name"], "--",
                "/opt/ibckpt/venv/bin/python", "-c", LEFT_ON_DISK, HOST_DIR, check=False,
            )  # fmt: skip
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert done.returncode == 0, f"exec in {agent['metadata']['name']}: {done.stderr[-2000:]}"
        out = done.stdout.split()
        found[agent["spec"]["nodeName"]] = (int(out[0]), int(out[1]))
    return found


def nothing_left_on_disk(installed: Release) -> None:
    """Within 120 s, no node keeps checkpoint images or restore staging (a kept failure's aside)."""
    deadline = time.monotonic() + 120
    while any(sum(left) for left in left_on_disk(installed).values()):
        assert time.monotonic() < deadline, f"(image, staging) bytes left per node: {left_on_disk(installed)}"
        time.sleep(5)
