"""The `ibckpt-operator` entry point as its own processes, two replicas against the real apiserver: flags,
health endpoints, metrics, jobs handled by the Lease holder only, a hand-over when the leader dies, and a
clean exit on SIGTERM that gives the Lease up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
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


def wait_answer(url: str, status: int, text: str, timeout: float = 60) -> None:
    """Until `url` answers `status` with `text` in its body."""
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                seen = f"{response.status} {response.read().decode()}"
        except urllib.error.HTTPError as error:
            seen = f"{error.code} {error.read().decode()}"
        except OSError as error:
            seen = str(error)
        if seen.startswith(str(status)) and text in seen:
            return
        time.sleep(0.5)
    raise AssertionError(f"{url}: wanted {status} {text!r}, last answer {seen!r}")


class OperatorProcess:
    """One `ibckpt-operator` process, as a replica of the Deployment runs it."""

    def __init__(self, kube: ControlPlane, name: str, lease: str, log: Path) -> None:
        self.name, self.log = name, log
        self.metrics, self.health = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig), "POD_NAME": name, "PYTHONFAULTHANDLER": "1"}
        args = [sys.executable, "-m", "ibckpt_operator.main", f"--namespace={OPERATOR_NS}",
                "--log-level=info", f"--metrics-port={self.metrics}", f"--liveness-port={self.health}",
                "--coordinator-port=0", "--coordinator-host=127.0.0.1", f"--lease-name={lease}",
                "--lease-seconds=6"]  # fmt: skip
        with log.open("w") as out:
            self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.health}{path}"

    def stop(self) -> int:
        """SIGTERM, as the kubelet stops a pod; its exit code."""
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack in the log
            self.process.wait(10)
            return -6


def checkpoint_job(cluster_ns: Any, s3_server: S3Server, bucket: str, name: str) -> dict[str, Any]:
    """A CheckpointJob of no pods, handled to the end: it fails with NoPods."""
    body = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": "none"}},
                 "storage": {"endpoint": s3_server.endpoint, "bucket": bucket,
                             "credentialsSecretRef": {"name": "s3-creds"}}},
    }  # fmt: skip
    cluster_ns.create("checkpointjobs", body)
    return cluster_ns.wait(  # type: ignore[no-any-return]
        "checkpointjobs", name, lambda o: (o.get("status") or {}).get("phase") == "Failed"
    )


def test_two_replicas_one_leads_the_standby_is_ready_and_takes_over(
    kube: ControlPlane, cluster_ns: Any, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """`operator.replicas: 2`: both processes answer their probes at once (a standby is alive and Ready,
    so a rolling update goes on), only the Lease holder handles jobs, and a leader killed without a
    goodbye is replaced once its Lease runs out. A clean exit gives the Lease up."""
    cluster_ns.s3_secret(s3_server)
    lease = "process-test-" + cluster_ns.namespace
    coordination = kubernetes.client.CoordinationV1Api(cluster_ns.api)

    def holder() -> str | None:
        return coordination.read_namespaced_lease(lease, OPERATOR_NS).spec.holder_identity  # type: ignore[no-any-return]

    first = OperatorProcess(kube, "operator-process-a", lease, tmp_path / "a.log")
    second = None
    try:
        wait_answer(first.url("/readyz"), 200, "leader")
        second = OperatorProcess(kube, "operator-process-b", lease, tmp_path / "b.log")
        wait_answer(second.url("/healthz"), 200, "standby: operator-process-a holds")
        wait_answer(second.url("/readyz"), 200, "standby: operator-process-a holds")
        done = checkpoint_job(cluster_ns, s3_server, bucket, "by-process")
        assert done["status"]["reason"] == "NoPods"
        assert "ibckpt_operator_leader 1.0" in wait_http(f"http://127.0.0.1:{first.metrics}/metrics")
        assert "ibckpt_operator_leader 0.0" in wait_http(f"http://127.0.0.1:{second.metrics}/metrics")
        assert holder() == "operator-process-a"
        assert "by-process" not in second.log.read_text()  # the standby handled nothing

        first.process.kill()  # a node lost: no clean exit, the Lease stays until it runs out
        first.process.wait(10)
        wait_answer(second.url("/readyz"), 200, "leader", timeout=90)
        assert holder() == "operator-process-b"
        done = checkpoint_job(cluster_ns, s3_server, bucket, "after-handover")
        assert done["status"]["reason"] == "NoPods"
    finally:
        first.stop()
        code = second.stop() if second is not None else 0
    output = second.log.read_text()
    assert code == 0, output[-3000:]
    for log in (first.log, second.log):
        assert s3_server.secret_key not in log.read_text()  # credentials never reach the log
    assert not holder()


def test_a_deposed_leader_is_gone_before_its_lease_could_run_out(
    kube: ControlPlane, cluster_ns: Any, tmp_path: Path
) -> None:
    """Another replica writes itself into the Lease (a leader that was partitioned and came back): the
    deposed process stops before the Lease it held could have run out, and says why."""
    lease = "process-deposed-" + cluster_ns.namespace
    coordination = kubernetes.client.CoordinationV1Api(cluster_ns.api)
    leader = OperatorProcess(kube, "operator-process-deposed", lease, tmp_path / "deposed.log")
    try:
        wait_answer(leader.url("/readyz"), 200, "leader")
        taken = coordination.read_namespaced_lease(lease, OPERATOR_NS)
        taken.spec.holder_identity = "another-replica"
        taken.spec.renew_time = datetime.now(UTC)
        coordination.replace_namespaced_lease(lease, OPERATOR_NS, taken)
        deposed = time.monotonic()
        leader.process.wait(6 + 2)  # --lease-seconds=6, and the lease watch's 1 s poll
        gone = time.monotonic() - deposed
    finally:
        leader.stop()
    output = leader.log.read_text()
    assert "lost Lease" in output and "another operator holds it" in output, output[-3000:]
    assert gone < 6, f"{gone:.1f} s"


def test_the_fence_ends_a_process_whose_shutdown_hangs() -> None:
    """What the fence is for: a thread that never returns (a call stuck in an executor) would keep the
    deposed process alive through the interpreter's exit."""
    script = (
        "import threading, time\n"
        "from ibckpt_operator.main import fence\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "fence(1.0)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30
    assert "exiting now" in done.stderr, done.stderr
