"""The chart installed once per session into the testbed cluster, shared by the tests in this directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed import pods
from testbed.cluster import Cluster
from testbed.release import STORAGE_SECRET, Release, install, sa_token, storage_secret
from testbed.s3 import S3Server

__all__ = ["STORAGE_SECRET", "Release", "sa_token"]

RELEASE = "ibckpt-t"
NAMESPACE = "ibckpt-helm"
OPERATOR_SA = f"{RELEASE}-operator"
AGENT_SA = f"{RELEASE}-agent"
AGENT_PORT = 9478
METRICS_PORT = 9479


@pytest.fixture(scope="session")
def installed(cluster: Cluster, s3_server: S3Server) -> Iterator[Release]:
    """The chart, installed once for the session; its namespace holds the session's S3 keys under the
    storage Secret's name (the agents stage images with them)."""
    pods.namespace(cluster, NAMESPACE)
    storage_secret(cluster, NAMESPACE, s3_server.access_key, s3_server.secret_key)
    release = install(cluster, RELEASE, NAMESPACE, log_level="debug")
    try:
        yield release
    finally:
        release.uninstall()
