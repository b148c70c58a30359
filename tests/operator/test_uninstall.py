"""`kubectl ibckpt uninstall`, run as an administrator runs it before `helm uninstall`, against the real
apiserver, the operator and the real S3 (node agents are the fakes of conftest.py): it refuses while a job
runs and changes nothing; told `--yes` once none runs, it leaves no schedule, job, Checkpoint (their
images kept in S3), schedule-owned PodDisruptionBudget, webhook configuration or storage Role and
RoleBinding the operator made for its job (other Roles stay); and Checkpoints whose operator is gone lose
their finalizers instead of hanging their namespace."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from typing import Any

import kubernetes
import pytest

from ibckpt.api import GROUP, VERSION
from testbed.cluster import kubectl_bin, kubectl_ibckpt
from testbed.kube import ControlPlane
from testbed.s3 import S3Server

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3]
API = f"{GROUP}/{VERSION}"


def plugin(kube: ControlPlane, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return kubectl_ibckpt(kube.kubeconfig, namespace, *args, timeout=180)


def s3_keys(s3: S3Server, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])}


def kubectl(kube: ControlPlane, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [str(kubectl_bin()), "--kubeconfig", str(kube.kubeconfig), *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def owned_budget(kube: ControlPlane, namespace: str, schedule: dict[str, Any]) -> None:
    """What drain protection keeps for a schedule: a maxUnavailable-0 PDB it owns (policy/v1beta1, 1.20)."""
    owner = {"apiVersion": API, "kind": "CheckpointSchedule", "name": "nightly", "controller": True}
    body = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": "ibckpt-nightly",
            "namespace": namespace,
            "ownerReferences": [{**owner, "uid": schedule["metadata"]["uid"]}],
        },
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "ring"}}},
    }
    kubectl(kube, "create", "-f", "-", stdin=json.dumps(body))


def webhook_configurations(cluster_ns: Cluster) -> set[str]:
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster_ns.api)
    validating = admission.list_validating_webhook_configuration().items
    mutating = admission.list_mutating_webhook_configuration().items
    return {f"validating/{c.metadata.name}" for c in validating} | {
        f"mutating/{c.metadata.name}" for c in mutating
    }


def test_uninstall_refuses_while_a_job_runs_then_leaves_nothing_behind(
    kube: ControlPlane,
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
) -> None:
    ns = cluster_ns.namespace
    config = store_config(bucket)
    done = agents.add(cluster_ns, "node-a", 1, "complete", config)
    stuck = agents.add(cluster_ns, "node-b", 2)  # "hang": its job stays Quiescing
    cluster_ns.rank_pod(done, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(stuck, "busy-0", {"app": "busy"})
    cluster_ns.s3_secret(s3_server)
    location = cluster_ns.s3_location(s3_server, bucket)
    storage = {
        "apiVersion": API,
        "kind": "CheckpointStorage",
        "metadata": {"name": "store"},
        "spec": location,
    }
    cluster_ns.create("checkpointstorages", {**storage, "spec": location})
    schedule = cluster_ns.create("checkpointschedules", {
        "apiVersion": API, "kind": "CheckpointSchedule", "metadata": {"name": "nightly"},
        "spec": {"intervalSeconds": 3600, "suspend": True,
                 "template": {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "store"}}},
    })  # fmt: skip
    owned_budget(kube, ns, schedule)
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster_ns.api)
    for create in (
        admission.create_validating_webhook_configuration,
        admission.create_mutating_webhook_configuration,
    ):
        try:
            create({"metadata": {"name": "ibckpt.io"}, "webhooks": []})
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster_ns.api)
    rbac.create_namespaced_role(ns, {"metadata": {"name": "keep-me"}, "rules": []})  # not ibckpt's
    grant = "ibckpt-agent-storage"  # the operator's Role and RoleBinding for its job's storage Secret
    release = "rel-" + secrets.token_hex(3)  # other tests on this apiserver label grants of their own
    try:
        with operator(release=release):
            made = plugin(kube, ns, "checkpoint", "-l", "app=ring", "--name", "ring-a", "--storage", "store")
            assert made.returncode == 0, made.stderr
            checkpoint = cluster_ns.get("checkpointjobs", "ring-a")["status"]["checkpointName"]
            manifest = cluster_ns.get("checkpoints", checkpoint)["spec"]["manifestKey"]
            running = plugin(kube, ns, "checkpoint", "-l", "app=busy", "--name", "busy-a", "--no-wait")
            assert running.returncode == 0, running.stderr
            cluster_ns.wait(
                "checkpointjobs", "busy-a", lambda b: (b.get("status") or {}).get("phase") == "Quiescing"
            )

            refused = plugin(kube, ns, "uninstall", "--yes")
            assert refused.returncode == 1, refused.stdout
            assert f"CheckpointJob {ns}/busy-a (Quiescing)" in refused.stderr, refused.stderr
            assert cluster_ns.get("checkpointschedules", "nightly") is not None  # nothing was touched

            cluster_ns.delete("checkpointjobs", "busy-a")  # the operator aborts it and lets it go
            deadline = time.monotonic() + 60
            while cluster_ns.get("checkpointjobs", "busy-a") is not None:
                assert time.monotonic() < deadline, "busy-a was never let go"
                time.sleep(0.5)
            said = plugin(kube, ns, "uninstall")  # without --yes: what it would do, nothing done
            assert said.returncode == 0 and "would (run again with --yes)" in said.stdout, said.stdout
            assert "PodDisruptionBudget(s)" in said.stdout and cluster_ns.get("checkpoints", checkpoint)
            # other tests' operators on this apiserver made grants too: this release's are these two
            ours = plugin(kube, ns, "uninstall", "--release", release)
            assert f"delete 2 storage Role(s) and RoleBinding(s) of the node agents ({ns})" in ours.stdout
            role = rbac.read_namespaced_role(grant, ns)  # the checkpoint made it, labelled
            assert role.metadata.labels["app.kubernetes.io/instance"] == release
            other = plugin(kube, ns, "uninstall", "--release", release + "-b")  # another release's: none
            assert "delete 0 storage Role(s)" in other.stdout, other.stdout

            done_ = plugin(kube, ns, "uninstall", "--yes", "--timeout", "30")
            assert done_.returncode == 0, done_.stdout + done_.stderr
        for plural in ("checkpointschedules", "checkpointjobs", "restorejobs", "checkpoints"):
            left = cluster_ns.custom.list_cluster_custom_object(GROUP, VERSION, plural)["items"]
            assert not left, [o["metadata"]["name"] for o in left]
        assert manifest in s3_keys(s3_server, bucket)  # the images stay by default
        assert not {"validating/ibckpt.io", "mutating/ibckpt.io"} & webhook_configurations(cluster_ns)
        budgets = json.loads(kubectl(kube, "get", "pdb", "-n", ns, "-o", "json"))["items"]
        assert not budgets, budgets
        assert [r.metadata.name for r in rbac.list_namespaced_role(ns).items] == ["keep-me"]
        assert not [b.metadata.name for b in rbac.list_namespaced_role_binding(ns).items]

        # With the operator gone, a Checkpoint's finalizer would hang its namespace: removed instead.
        orphan = {"apiVersion": API, "kind": "Checkpoint",
                  "metadata": {"name": "orphan", "finalizers": ["ibckpt.io/finalizer"]},
                  "spec": {"storageRef": {"name": "store"}, "manifestKey": "x"}}  # fmt: skip
        cluster_ns.create("checkpoints", orphan)
        gone = plugin(kube, ns, "uninstall", "--yes", "--timeout", "2")
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert f"removed the finalizer of Checkpoint {ns}/orphan" in gone.stdout, gone.stdout
        assert cluster_ns.get("checkpoints", "orphan") is None
    finally:
        cluster_ns.drop_all("checkpointschedules")
