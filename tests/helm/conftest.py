"""The chart installed once per session into the testbed cluster, shared by the tests in this directory."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.release import STORAGE_SECRET, Release, install, sa_token, storage_secret
from testbed.ring import PRODUCT_NS
from testbed.s3 import S3Server

__all__ = ["STORAGE_SECRET", "Release", "sa_token"]

RELEASE = "ibckpt-t"
NAMESPACE = PRODUCT_NS
OPERATOR_SA = f"{RELEASE}-operator"
AGENT_SA = f"{RELEASE}-agent"
AGENT_PORT = 9478
METRICS_PORT = 9479
JOB_NS = "team-ring"


@pytest.fixture(scope="session")
def installed(cluster: Cluster, s3_server: S3Server) -> Iterator[Release]:
    """The chart, installed once for the session; its namespace holds the session's S3 keys under the
    storage Secret's name (the agents stage images with them)."""
    pods.namespace(cluster, NAMESPACE)
    storage_secret(cluster, NAMESPACE, s3_server.access_key, s3_server.secret_key)
    # The operator stays on node-2: the drain test drains node-1 (docs/drains.md: keep the operator off the
    # nodes it migrates; a drain of its own node restarts it elsewhere mid-migration, which is not tested).
    # Failpoints on: test_faults holds an agent between its ranks' quiesce and drain to hang it there.
    release = install(cluster, RELEASE, NAMESPACE, log_level="debug", operator_node="node-2", failpoints=True)
    try:
        yield release
    finally:
        release.uninstall()


@pytest.fixture
def job_ns(installed: Release, s3_server: S3Server) -> Iterator[str]:
    """A team's namespace with its storage: a CheckpointStorage `store` and its credentials Secret."""
    cluster = installed.cluster
    pods.namespace(cluster, JOB_NS)
    bucket = f"ring-job-{secrets.token_hex(3)}"
    s3_server.create_bucket(bucket)
    storage_secret(cluster, JOB_NS, s3_server.access_key, s3_server.secret_key)
    pods.apply(cluster, JOB_NS, ring.storage(s3_server.endpoint, bucket))
    try:
        yield JOB_NS
    finally:
        pods.delete_namespace(cluster, JOB_NS)
