"""The chart installed once per session into the testbed cluster, shared by the tests in this directory."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from testbed import pods
from testbed.cluster import Cluster
from testbed.guest import REPO, cache_dir
from testbed.images import PRODUCT_IMAGE
from testbed.s3 import S3Server

RELEASE = "ibckpt-t"
NAMESPACE = "ibckpt-helm"
OPERATOR_SA = f"{RELEASE}-operator"
AGENT_SA = f"{RELEASE}-agent"
STORAGE_SECRET = "s3-credentials"
AGENT_PORT = 9478
METRICS_PORT = 9479
CHART = REPO / "charts" / "ibckpt"


@dataclass
class Installed:
    cluster: Cluster
    namespace: str
    notes: str

    def agent_pods(self) -> list[dict[str, Any]]:
        found = pods.get(self.cluster, self.namespace, "pods", **{"app.kubernetes.io/component": "agent"})
        return list(found["items"])


def helm(cluster: Cluster, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(cache_dir() / "helm" / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def sa_token(cluster: Cluster, namespace: str, account: str) -> str:
    """The token the serviceaccount-token controller stored for account (v1.20)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        secrets = json.loads(cluster.kubectl("get", "secrets", "-n", namespace, "-o", "json").stdout)["items"]
        for s in secrets:
            annotations = s["metadata"].get("annotations", {})
            if (
                s["type"] == "kubernetes.io/service-account-token"
                and annotations.get("kubernetes.io/service-account.name") == account
                and s.get("data", {}).get("token")
            ):
                return base64.b64decode(s["data"]["token"]).decode()
        time.sleep(1)
    raise AssertionError(f"no token Secret for {namespace}/{account} after 120 s")


def rollout(cluster: Cluster, what: str) -> None:
    proc = cluster.kubectl(
        "rollout", "status", "-n", NAMESPACE, what, "--timeout=600s", timeout=620, check=False
    )
    if proc.returncode != 0:
        described = cluster.kubectl("describe", "pods", "-n", NAMESPACE, check=False).stdout
        logs = cluster.kubectl(
            "logs", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}", "--tail=30", check=False
        )
        raise AssertionError(
            f"{what} not rolled out:\n{proc.stdout}{proc.stderr}\n{described[-5000:]}\n"
            f"{logs.stdout[-3000:]}{cluster.diagnose()}"
        )


@pytest.fixture(scope="session")
def installed(cluster: Cluster, s3_server: S3Server) -> Iterator[Installed]:
    pods.namespace(cluster, NAMESPACE)
    # the agents' one readable Secret: the session's S3 keys (the agents stage images with them)
    cluster.kubectl(
        "create", "secret", "generic", STORAGE_SECRET, "-n", NAMESPACE,
        f"--from-literal=AWS_ACCESS_KEY_ID={s3_server.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={s3_server.secret_key}",
    )  # fmt: skip
    repository, tag = PRODUCT_IMAGE.rsplit(":", 1)
    try:
        out = helm(
            cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never", "--set", f"storage.credentialsSecret={STORAGE_SECRET}",
            "--set", "logLevel=debug", "--set", "runtimeClass.nodeLabelValue=rxe",
        )  # fmt: skip
        rollout(cluster, f"daemonset/{RELEASE}-agent")
        yield Installed(cluster, NAMESPACE, out.stdout)
    finally:
        helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s")
        pods.delete_namespace(cluster, NAMESPACE)
