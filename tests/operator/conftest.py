"""Fixtures for the operator's handler tests: the real apiserver (v1.20) with the CRDs, the real S3, the
operator run in-process under kopf's KopfRunner, and fake node agents that speak ibckpt.agentapi over
HTTPS on 127.0.0.x, with the certificate of the Secret the operator keeps (the agent is the one part
faked at this level; the cluster tests use the real one).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from ibckpt.api import GROUP, VERSION
from ibckpt.store import StoreConfig
from ibckpt.tls import CERT_FILE, KEY_FILE, server_context
from ibckpt_operator.cluster.kube import Kube
from ibckpt_operator.config import OperatorConfig
from testbed import operator_account as chart_rbac
from testbed.fake_agent import FakeAgent
from testbed.kube import ControlPlane, establish_crds
from testbed.ports import free_port
from testbed.s3 import S3Server
from testbed.tlsfiles import make_pki

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
OPERATOR_NS = "ibckpt-system"


# -- the apiserver ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def crds(kube_api: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    establish_crds(kube_api, [yaml.safe_load(path.read_text()) for path in sorted(CRD_DIR.glob("*.yaml"))])
    core = kubernetes.client.CoreV1Api(kube_api)
    try:
        core.create_namespace({"metadata": {"name": OPERATOR_NS}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    return kube_api


@dataclass
class Cluster:
    """Plays the kubelet: nodes, pods and their status, envtest-style."""

    api: kubernetes.client.ApiClient
    namespace: str

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    def node(self, name: str, ready: bool = True) -> None:
        try:
            self.core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
        status = "True" if ready else "False"
        self.core.patch_node_status(name, {"status": {"conditions": [{"type": "Ready", "status": status,
                                                       "reason": "Test", "message": "test"}]}})  # fmt: skip

    def pod(
        self,
        name: str,
        node: str,
        labels: dict[str, str] | None = None,
        namespace: str | None = None,
        ip: str = "10.1.0.1",
        ready: bool = True,
        owners: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        ns = namespace or self.namespace
        meta: dict[str, Any] = {"name": name, "labels": labels or {}}
        if owners:
            meta["ownerReferences"] = owners
        body = {
            "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "ring:test"}]},
        }
        created = self.core.create_namespaced_pod(ns, body)
        cond = "True" if ready else "False"
        status = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": cond}]}
        self.core.patch_namespaced_pod_status(name, ns, {"status": status})
        return {"name": name, "uid": created.metadata.uid, "node": node}

    def rank_pod(self, agent: FakeAgent, name: str, labels: dict[str, str]) -> None:
        """A pod on the agent's node whose container the agent serves as a rank."""
        agent.register(self.pod(name, agent.node, labels), self.namespace)

    def report_killed(self, name: str) -> None:
        """What a kubelet reports of a pod it killed, before its cleanup lets it go: not ready, its
        container terminated. Waits until the pod is being deleted."""
        deadline = time.monotonic() + 60
        while self.core.read_namespaced_pod(name, self.namespace).metadata.deletion_timestamp is None:
            assert time.monotonic() < deadline, f"{name} was never killed"
            time.sleep(0.2)
        ended = {"terminated": {"exitCode": 143, "reason": "Error"}}
        statuses = [{"name": "main", "state": ended, "ready": False, "restartCount": 0, "image": "ring:test",
                     "imageID": "", "containerID": "containerd://0"}]  # fmt: skip
        status = {"containerStatuses": statuses, "conditions": [{"type": "Ready", "status": "False"}]}
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    def agent_pod(self, node: str, ip: str, ready: bool = True) -> None:
        labels = {"app.kubernetes.io/component": "agent", "app.kubernetes.io/instance": "ibckpt"}
        self.pod(f"agent-{node}", node, labels, namespace=OPERATOR_NS, ip=ip, ready=ready)

    def agent_pod_ready(self, node: str, ready: bool = True) -> None:
        status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        self.core.patch_namespaced_pod_status(f"agent-{node}", OPERATOR_NS, {"status": status})

    def secret(self, name: str, data: dict[str, str]) -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        self.core.create_namespaced_secret(self.namespace, {"metadata": {"name": name}, "data": encoded})

    def s3_secret(self, s3: S3Server) -> None:
        """The Secret `s3-creds` with the test server's keys, the one the tests' storage locations name."""
        self.secret("s3-creds", {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key})

    @staticmethod
    def s3_location(s3: S3Server, bucket: str) -> dict[str, Any]:
        """A storage location in the test server's bucket, read with the keys of `s3_secret`."""
        return {
            "endpoint": s3.endpoint,
            "region": s3.region,
            "bucket": bucket,
            "credentialsSecretRef": {"name": "s3-creds"},
        }

    def create(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, plural, body
        )
        return result

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, name
            )
            return result
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_status(self, plural: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, plural, name, {"status": status}
        )

    def patch(self, plural: str, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name, body)

    def delete(self, plural: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)

    def wait(
        self, plural: str, name: str, check: Callable[[dict[str, Any]], bool], timeout: float = 60
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            last = self.get(plural, name)
            if last is not None and check(last):
                return last
            time.sleep(0.3)
        seen = json.dumps((last or {}).get("status"), indent=1)[:4000]
        raise AssertionError(f"{plural}/{name} never got there; last status: {seen}")

    def events(self, name: str) -> list[Any]:
        items = self.core.list_namespaced_event(self.namespace).items
        return [e for e in items if e.involved_object.name == name]

    def wait_events(self, name: str, reason: str, count: int = 1, timeout: float = 60) -> list[Any]:
        """The Events of this reason on the object, once there are `count` of them."""
        deadline = time.monotonic() + timeout
        while len(found := [e for e in self.events(name) if e.reason == reason]) < count:
            assert time.monotonic() < deadline, (
                f"no {reason} Event on {name}: {[e.reason for e in self.events(name)]}"
            )
            time.sleep(0.2)
        return found

    def pod_uid_and_origin(self, namespace: str, name: str) -> tuple[str, str] | None:
        """The pod's uid and its ibckpt.io/restore-from annotation (what a node's runtime sees), or None."""
        try:
            pod = self.core.read_namespaced_pod(name, namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return pod.metadata.uid, (pod.metadata.annotations or {}).get("ibckpt.io/restore-from", "")

    def pod_names(self) -> list[str]:
        return sorted(p.metadata.name for p in self.core.list_namespaced_pod(self.namespace).items)

    def drop_all(self, plural: str) -> None:
        """Delete every object of one of the operator's kinds in the namespace, finalizers and all: none
        may run under the next test's operator."""
        custom = self.custom
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, plural)["items"]:
            name = item["metadata"]["name"]
            try:
                custom.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, plural, name, {"metadata": {"finalizers": None}}
                )
                custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise

    def pdb(self, name: str) -> dict[str, Any] | None:
        """The PodDisruptionBudget of this name (policy/v1beta1, the version of a 1.20 apiserver)."""
        path = f"/apis/policy/v1beta1/namespaces/{self.namespace}/poddisruptionbudgets/{name}"
        method, url, headers, _, _ = self.api.param_serialize("GET", path, auth_settings=["BearerToken"])
        response = self.api.call_api(method, url, header_params=headers)
        data = response.read()
        if response.status == 404:
            return None
        assert response.status == 200, data
        return dict(json.loads(data))


@pytest.fixture
def runtime_class(crds: kubernetes.client.ApiClient) -> None:
    """The chart's RuntimeClass: the apiserver refuses a pod that names a class it does not know."""
    node = kubernetes.client.NodeV1Api(crds)
    try:
        node.create_runtime_class({"metadata": {"name": "ibckpt"}, "handler": "ibckpt"})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


@pytest.fixture
def cluster_ns(crds: kubernetes.client.ApiClient) -> Iterator[Cluster]:
    name = "t-" + secrets.token_hex(4)
    kubernetes.client.CoreV1Api(crds).create_namespace({"metadata": {"name": name}})
    cluster = Cluster(crds, name)
    yield cluster
    for plural in ("checkpointjobs", "restorejobs", "checkpoints"):
        cluster.drop_all(plural)


# -- S3 -------------------------------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = "ops-" + secrets.token_hex(5)
    s3_server.create_bucket(name)
    return name


@pytest.fixture
def store_config(s3_server: S3Server) -> Callable[[str], StoreConfig]:
    """The store configuration the fake agents write with (the operator reads the Secret instead)."""
    return lambda bucket: _store_config(s3_server, bucket)


def _store_config(s3: S3Server, bucket: str, prefix: str = "ibckpt") -> StoreConfig:
    return s3.store_config(bucket, prefix=prefix, chunk_size=64 * 1024, workers=2, max_attempts=2)


# -- fake node agents -------------------------------------------------------------------------------------


@dataclass
class Agents:
    port: int
    tls: ssl.SSLContext
    by_node: dict[str, FakeAgent] = field(default_factory=dict)

    def add(self, cluster: Cluster, node: str, index: int, behaviour: str = "hang",
            store: StoreConfig | None = None, ready: bool = True) -> FakeAgent:  # fmt: skip
        host = f"127.0.0.{index}"
        cluster.node(node)
        cluster.agent_pod(node, host, ready=ready)
        agent = FakeAgent(node, host, self.port, behaviour, store, tls=self.tls)
        agent.pod_lookup = cluster.pod_uid_and_origin
        agent.start()
        self.by_node[node] = agent
        return agent


def ensure_operator_account(core: kubernetes.client.CoreV1Api) -> None:
    """The operator's service account, whose tokens (one per node) it requests for the agents."""
    try:
        core.create_namespaced_service_account(OPERATOR_NS, {"metadata": {"name": "ibckpt-operator"}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def release_tls(core: kubernetes.client.CoreV1Api, directory: Path) -> ssl.SSLContext:
    """The internal TLS Secrets as an earlier operator left them (the operator keeps them as they are),
    and the agents' serving context from their Secret, as the DaemonSet mounts it."""
    pki = make_pki()
    defaults = OperatorConfig()
    for name, data in (
        (defaults.tls_ca_secret, pki.ca.data()),
        (defaults.agent_tls_secret, pki.agent.data()),
    ):
        encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
        body = {"metadata": {"name": name}, "type": "kubernetes.io/tls", "data": encoded}
        try:
            core.delete_namespaced_secret(name, OPERATOR_NS)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
        core.create_namespaced_secret(OPERATOR_NS, body)
    mounted = pki.agent_dir(directory)
    return server_context(mounted / CERT_FILE, mounted / KEY_FILE)


@pytest.fixture
def agents(crds: kubernetes.client.ApiClient, tmp_path: Path) -> Iterator[Agents]:
    ensure_operator_account(kubernetes.client.CoreV1Api(crds))
    found = Agents(free_port(), release_tls(kubernetes.client.CoreV1Api(crds), tmp_path / "agent-tls"))
    yield found
    for agent in found.by_node.values():
        agent.stop()
    core = kubernetes.client.CoreV1Api(crds)
    for node in found.by_node:
        core.delete_namespaced_pod(f"agent-{node}", OPERATOR_NS, grace_period_seconds=0)


# -- the operator, in-process -------------------------------------------------------------------------------


@dataclass
class OperatorHandle:
    metrics_port: int
    config: Any

    def metrics(self) -> str:
        """The operator's /metrics page, as text."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return str(urllib.request.urlopen(url, timeout=10).read().decode())


@pytest.fixture
def operator(
    kube: ControlPlane, crds: kubernetes.client.ApiClient, agents: Agents, tmp_path: Path
) -> Iterator[Callable[..., Any]]:
    """Start (and restart) the operator under KopfRunner: `with operator() as handle: ...`."""
    from kopf.testing import KopfRunner

    from ibckpt_operator import config as settings

    os.environ["KUBECONFIG"] = str(kube.kubeconfig)
    metrics_port = free_port()
    lease_name = "ibckpt-operator-" + secrets.token_hex(3)
    saved = settings.current()

    @contextmanager
    def run(**overrides: Any) -> Iterator[OperatorHandle]:
        config = saved.with_(
            namespace=OPERATOR_NS,
            identity="test-operator",
            lease_name=lease_name,
            lease_seconds=6.0,
            metrics_port=metrics_port,
            metrics_host="127.0.0.1",
            coordinator_host="127.0.0.1",
            coordinator_bind="127.0.0.1",
            coordinator_port=0,
            agent_port=agents.port,
            operator_account="ibckpt-operator",  # its tokens for the agents (made in `agents`)
            agent_account="ibckpt-agent",  # each job grants the agents its storage's Secret (Role)
            agent_timeout=3.0,
            gc_grace_seconds=0.0,
            poll_seconds=0.3,
            tick_seconds=2.0,
        ).with_(**overrides)
        settings.configure(config)
        args = ["run", "-A", "--standalone", "-m", "ibckpt_operator.handlers"]
        try:
            with KopfRunner(args, timeout=60) as runner:
                yield OperatorHandle(metrics_port, config)
        finally:  # a failed test must not leave its settings to the next ones
            settings.configure(saved)
        assert runner.exception is None or isinstance(runner.exception, SystemExit), runner.output[-3000:]

    yield run


@pytest.fixture
def operator_account(kube_api: kubernetes.client.ApiClient) -> Iterator[tuple[Kube, str, str]]:
    """The chart's RBAC for a fresh release applied; a Kube client impersonating its operator's account,
    the webhook Secret's name, the Deployment's name."""
    yield from chart_rbac.operator_account(kube_api)
