"""The PodDisruptionBudget of a protected workload named by owner (workloadRef): its selector is the
workload controller's own, it is owned by the schedule, and the garbage collector removes it with the
schedule. Real apiserver v1.20 (policy/v1beta1 by discovery) with its garbage collector."""

from __future__ import annotations

import time
from typing import Any

import kubernetes
import pytest

from ibckpt.api import API_VERSION

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube]


def test_a_workload_by_owner_is_protected_by_its_own_selector_until_the_schedule_goes(
    cluster_ns: Cluster, agents: Agents, operator: Any
) -> None:
    apps = kubernetes.client.AppsV1Api(cluster_ns.api)
    labels = {"app": "ring", "tier": "mpi"}
    template = {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": "main", "image": "ring:test"}]},
    }
    owner = apps.create_namespaced_stateful_set(
        cluster_ns.namespace,
        {
            "metadata": {"name": "ring"},
            "spec": {
                "serviceName": "ring",
                "replicas": 0,
                "selector": {"matchLabels": labels},
                "template": template,
            },
        },
    )
    ref = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "ring", "uid": owner.metadata.uid}]
    agents.add(cluster_ns, "node-a", 1)
    cluster_ns.pod("ring-0", "node-a", labels, owners=ref)
    schedule = {
        "apiVersion": API_VERSION,
        "kind": "CheckpointSchedule",
        "metadata": {"name": "ring"},
        "spec": {
            "drain": {},
            "template": {
                "workloadRef": {"kind": "StatefulSet", "name": "ring"},
                "storageRef": {"name": "lab-s3"},
            },
        },
    }
    with operator():
        created = cluster_ns.create("checkpointschedules", schedule)
        body = cluster_ns.wait(
            "checkpointschedules", "ring", lambda o: bool((o.get("status") or {}).get("protectedBy"))
        )
        assert body["status"]["protectedBy"] == "policy/v1beta1/ibckpt-ring"
        budget = cluster_ns.pdb("ibckpt-ring")
        assert budget is not None
        assert budget["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": labels}}
        owner_ref = budget["metadata"]["ownerReferences"][0]
        assert owner_ref["kind"] == "CheckpointSchedule" and owner_ref["uid"] == created["metadata"]["uid"]
        assert owner_ref["controller"] is True
        # The pod was not labelled: the StatefulSet's selector is enough.
        pod = cluster_ns.core.read_namespaced_pod("ring-0", cluster_ns.namespace)
        assert "ibckpt.io/protected-by" not in (pod.metadata.labels or {})
        cluster_ns.delete("checkpointschedules", "ring")
        deadline = time.monotonic() + 60
        while cluster_ns.get("checkpointschedules", "ring") is not None:  # kopf's finalizer, then gone
            assert time.monotonic() < deadline, "the schedule was never deleted"
            time.sleep(0.3)
    deadline = time.monotonic() + 60
    while cluster_ns.pdb("ibckpt-ring") is not None:  # the garbage collector follows the owner
        assert time.monotonic() < deadline, "the PDB outlived its schedule"
        time.sleep(0.3)
