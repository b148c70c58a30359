"""The `ibckpt-operator` entry point as its own process: flags, liveness, metrics, a job handled, and a
clean exit on SIGTERM that gives the Lease up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from testbed.kube import ControlPlane
from testbed.ports import free_port
from testbed.s3 import S3Server

pytestmark = [pytest.mark.kube, pytest.mark.s3]
OPERATOR_NS = "ibckpt-system"


def wait_http(url: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return str(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.5)


def test_entry_point_runs_leads_and_exits_cleanly(
    kube: ControlPlane, cluster_ns: Any, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    cluster_ns.s3_secret(s3_server)
    metrics, liveness, lease = free_port(), free_port(), "process-test-" + cluster_ns.namespace
    log = tmp_path / "operator.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(kube.kubeconfig),
        "POD_NAME": "operator-process-test",
        "PYTHONFAULTHANDLER": "1",
    }
    args = [sys.executable, "-m", "ibckpt_operator.main", f"--namespace={OPERATOR_NS}", "--log-level=info",
            f"--metrics-port={metrics}", f"--liveness-port={liveness}", "--coordinator-port=0",
            "--coordinator-host=127.0.0.1", f"--lease-name={lease}", "--lease-seconds=6"]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_http(f"http://127.0.0.1:{liveness}/healthz") is not None
        body = {
            "apiVersion": "ibckpt.io/v1alpha1",
            "kind": "CheckpointJob",
            "metadata": {"name": "by-process"},
            "spec": {"selector": {"matchLabels": {"app": "none"}},
                     "storage": {"endpoint": s3_server.endpoint, "bucket": bucket,
                                 "credentialsSecretRef": {"name": "s3-creds"}}},
        }  # fmt: skip
        cluster_ns.create("checkpointjobs", body)
        done = cluster_ns.wait(
            "checkpointjobs", "by-process", lambda o: (o.get("status") or {}).get("phase") == "Failed"
        )
        assert done["status"]["reason"] == "NoPods"
        text = wait_http(f"http://127.0.0.1:{metrics}/metrics")
        assert "ibckpt_operator_leader 1.0" in text
        coordination = kubernetes.client.CoordinationV1Api(cluster_ns.api)
        assert (
            coordination.read_namespaced_lease(lease, OPERATOR_NS).spec.holder_identity
            == "operator-process-test"
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # with PYTHONFAULTHANDLER: every thread's stack in the log
            process.wait(10)
            code = -6
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert s3_server.secret_key not in output  # credentials never reach the log
    assert not coordination.read_namespaced_lease(lease, OPERATOR_NS).spec.holder_identity
