"""The chart installed into the testbed cluster with Helm, as a user installs it: used by tests/helm and
`make demo`. The testbed's images are local (pullPolicy Never) and its nodes carry `ibckpt.io/rdma=rxe`."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from testbed import pods
from testbed.cluster import WEBHOOK_NODE, Cluster
from testbed.guest import REPO, cache_dir
from testbed.images import PRODUCT_IMAGE

CHART = REPO / "charts" / "ibckpt"
SESSION_RELEASE = "ibckpt-t"  # the pytest session's release (tests/conftest.py `installed`)
# A team's S3 credentials Secret: a name the chart is not told (the operator grants the agents each
# storage's own Secret by name, in its namespace; docs/helm.md, "Storage Secrets").
STORAGE_SECRET = "team-s3-login"


@dataclass
class Release:
    cluster: Cluster
    name: str
    namespace: str
    notes: str

    def agent_pods(self) -> list[dict[str, Any]]:
        found = pods.get(self.cluster, self.namespace, "pods", **{"app.kubernetes.io/component": "agent"})
        return list(found["items"])

    def logs(self, component: str, tail: int = -1) -> str:
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"
        proc = self.cluster.kubectl(
            "logs",
            "-n",
            self.namespace,
            "-l",
            selector,
            f"--tail={tail}",
            "--max-log-requests=10",
            check=False,
        )
        return proc.stdout + proc.stderr

    def rollout(self, what: str) -> None:
        # The agents wait for the Secret the leading operator issues (its start took 6 min on a slow
        # day, 2026-12-02), then install, import and restart containerd: 600 s ran out twice then.
        proc = self.cluster.kubectl(
            "rollout", "status", "-n", self.namespace, what, "--timeout=900s", timeout=920, check=False
        )
        if proc.returncode != 0:
            # the pods of what did not roll out: their states, init containers and logs
            component = "agent" if what.endswith("-agent") else "operator"
            selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"
            described = self.cluster.kubectl(
                "describe", "pods", "-n", self.namespace, "-l", selector, check=False
            ).stdout
            raise AssertionError(
                f"{what} not rolled out:\n{proc.stdout}{proc.stderr}\n{described[-8000:]}\n"
                f"{self.logs(component, 30)[-3000:]}{self.cluster.diagnose()}"
            )

    def operator_leading(self, timeout_s: float = 600.0) -> str:
        """Wait until the operator started for real: its pod holds the Lease and its webhook configuration
        is up (it admits nothing before that). Its pod's name."""
        self.rollout(f"deployment/{self.name}-operator")
        selector = {"app.kubernetes.io/component": "operator"}
        found = pods.get(self.cluster, self.namespace, "pods", **selector)["items"]
        # after an upgrade the old pod may still be terminating
        [operator] = [p for p in found if not p["metadata"].get("deletionTimestamp")]
        name = str(operator["metadata"]["name"])
        deadline = time.monotonic() + timeout_s

        def holder() -> str | None:
            lease = pods.get(self.cluster, self.namespace, "lease", "ibckpt-operator")
            return lease.get("spec", {}).get("holderIdentity")  # type: ignore[no-any-return]

        while holder() != name:
            assert time.monotonic() < deadline, f"{name} never took the Lease"
            time.sleep(3)
        webhooks = ("get", "validatingwebhookconfiguration", "ibckpt.io")
        while self.cluster.kubectl(*webhooks, check=False).returncode:
            assert time.monotonic() < deadline, "the operator never made its webhook configuration"
            time.sleep(3)
        return name

    def uninstall(self) -> None:
        """helm uninstall, once (a test may have done it): its pre-delete hook has the agents undo their
        nodes, a Job of the product's image that takes minutes to start on the emulated nodes."""
        listed = helm(self.cluster, "list", "--namespace", self.namespace, "-q").stdout.split()
        if self.name in listed:
            helm(
                self.cluster, "uninstall", self.name, "--namespace", self.namespace,
                "--wait", "--timeout=900s", timeout=960,
            )  # fmt: skip
        pods.delete_namespace(self.cluster, self.namespace)


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


def storage_secret(cluster: Cluster, namespace: str, access_key: str, secret_key: str) -> None:
    """A team's S3 credentials Secret, under the name its CheckpointStorage gives."""
    cluster.kubectl(
        "create", "secret", "generic", STORAGE_SECRET, "-n", namespace,
        f"--from-literal=AWS_ACCESS_KEY_ID={access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={secret_key}",
    )  # fmt: skip


WEBHOOK_CLIENT_CA_SECRET = "apiserver-webhook-client-ca"
MEMORY_TIER_BYTES = 256 * 1024 * 1024
# Two of the store's 8 MiB chunks: the ring's small images never reach it; tests/helm/test_large_pod.py's do.
DISK_WINDOW_BYTES = 16 * 1024 * 1024


def install(
    cluster: Cluster,
    name: str,
    namespace: str,
    log_level: str = "info",
    operator_node: str | None = None,
    failpoints: bool = False,
    values: Sequence[str] = (),
) -> Release:
    """helm install the chart from the repository into `namespace` (it exists), and wait until every
    node's agent is ready. `operator_node`: the node the operator must run on; on the testbed's
    WEBHOOK_NODE its eviction webhook is published on the port the host forwards there, which is how
    the apiserver reaches it. `failpoints`: the agents honour armed failpoints (ibckpt_node.failpoints).
    `values`: more chart values, as `--set` takes them (a bench's agent memory limit)."""
    repository, tag = PRODUCT_IMAGE.rsplit(":", 1)
    pin = []
    if operator_node:
        pin += ["--set", f"operator.nodeSelector.kubernetes\\.io/hostname={operator_node}"]
    if operator_node == WEBHOOK_NODE:
        pin += [
            "--set", f"operator.webhook.port={cluster.webhook_port}",
            "--set", "operator.webhook.hostPort=true", "--set", "operator.webhook.host=127.0.0.1",
        ]  # fmt: skip
        # The apiserver presents its webhook client certificate; the admission server takes no other
        # caller (docs/security.md, "Admission caller"). The Secret is the admin's, not the release's.
        cluster.kubectl(
            "create", "secret", "generic", WEBHOOK_CLIENT_CA_SECRET, "-n", namespace,
            f"--from-file=ca.crt={cluster.plane.webhook_client_ca}",
        )  # fmt: skip
        pin += ["--set", f"operator.webhook.clientCA.secretName={WEBHOOK_CLIENT_CA_SECRET}"]
    # The emulated nodes answer a webhook call in seconds when loaded: the longest bound the chart
    # allows (15 s for a pod creation, 30 s for an eviction), so a restored pod is never created unbound.
    pin += ["--set", "operator.webhook.timeoutSeconds=15"]
    # A Lease renewal can be as slow there: with a 15 s Lease the leader steps down after 10 s without
    # one, and its restart takes minutes on these nodes. With 60 s a leader still restarted once, while
    # node-2's kubelet could not even finish TLS handshakes: 120 s (a step-down after 80 s).
    pin += ["--set", "operator.leaseSeconds=120"]
    # The memory tier on (docs/recovery.md, "Tiers"): the ring's parts are a few MB; 256 MiB per agent
    # fits the chart's 1 GiB agent limit and the 3 GiB guests.
    pin += ["--set", f"agent.memoryTier.bytes={MEMORY_TIER_BYTES}"]
    pin += ["--set", f"agent.diskWindowBytes={DISK_WINDOW_BYTES}"]
    for value in values:
        pin += ["--set", value]
    out = helm(
        cluster, "install", name, str(CHART), "--namespace", namespace,
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", "image.pullPolicy=Never",
        "--set", f"logLevel={log_level}", "--set", "agent.containerd.restart=signal",
        "--set", f"agent.failpoints={str(failpoints).lower()}", *pin,
    )  # fmt: skip
    release = Release(cluster, name, namespace, out.stdout)
    release.rollout(f"daemonset/{name}-agent")
    return release


def audience_token(cluster: Cluster, namespace: str, account: str, audience: str) -> str:
    """A token for account bound to audience, from the TokenRequest API (as the kubelet projects one)."""
    made = cluster.kubectl("create", "token", account, "-n", namespace, f"--audience={audience}")
    return made.stdout.strip()


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
