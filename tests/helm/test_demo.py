"""The README's first command must keep working. `make demo` boots the testbed cluster and installs the
chart exactly as this session's fixtures do (testbed.cluster.start_cluster, testbed.release.install), then
moves a two-pod verbs job with a CheckpointJob and a RestoreJob. That move is run here, on the session's
cluster and release, through the demo's own code and output: a second cluster boot and install would cost
the suite minutes and test nothing new."""

from __future__ import annotations

import io

import pytest
from helm.conftest import Release
from rich.console import Console

from testbed import demo, pods
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]


def test_the_demo_moves_the_job_through_s3_exactly_once(installed: Release, s3_server: S3Server) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120)
    try:
        ok = demo.move_job(console, installed.cluster, s3_server, installed)
    finally:
        pods.delete_namespace(installed.cluster, demo.JOB_NS)
    shown = out.getvalue()
    print(shown)
    assert ok, shown[-6000:]
    assert "committed in S3: 2 pods" in shown
    assert "checkpointjob move: Succeeded" in shown and "restorejob back: Succeeded" in shown
    assert "'ring-0': 'node-2', 'ring-1': 'node-1'" in shown  # restored on the other nodes
    assert "every message delivered exactly once" in shown
