"""A team's namespace beside the session's release of the chart (the `installed` fixture of
tests/conftest.py, which tests/cluster starts so that the operator starts while they run)."""

from __future__ import annotations

import secrets
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
