"""The memory tier through the operator, against the real apiserver and the real S3, with the fake agents of
testbed/fake_agent.py (tests/agent/test_memory_tier*.py has the real agents and the bytes): each node is
told to keep its part in the next node's agent, the Checkpoint says which tiers hold it and where each
copy lives, and a restore sends every agent the living copies and says what it read from memory."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from testbed.cluster import kubectl_ibckpt
from testbed.s3 import S3Server
from testbed.status import phase

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.usefixtures("runtime_class")]


API = "ibckpt.io/v1alpha1"
RING = {"app": "ring"}


def tiers(wanted: list[str]) -> Any:
    return lambda body: (body.get("status") or {}).get("tiers") == wanted


def stop_job(cluster: Cluster, s3: S3Server, bucket: str) -> dict[str, Any]:
    """A Stop CheckpointJob `move` of the ring's pods, committed as Checkpoint `ring-c1`."""
    return {"apiVersion": API, "kind": "CheckpointJob", "metadata": {"name": "move"},
            "spec": {"selector": {"matchLabels": RING}, "storage": cluster.s3_location(s3, bucket),
                     "mode": "Stop", "checkpointName": "ring-c1"}}  # fmt: skip


def test_parts_go_to_the_next_nodes_memory_and_a_restore_reads_them_there(
    kube: Any,
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    # a third node with a ready agent and no pod of the job: the ring is a -> b -> c -> a
    c = agents.add(cluster_ns, "node-c", 3, "complete", config)
    # node-a's copy is in the report that ends its session, node-b's comes after its own: the Checkpoint
    # must list both (a CI run listed only the part whose copy came first, and never the other)
    a.copy_in_last_report = True
    cluster_ns.rank_pod(a, "ring-0", RING)
    cluster_ns.rank_pod(b, "ring-1", RING)
    cluster_ns.s3_secret(s3_server)
    with operator(memory_tier=True):
        cluster_ns.create("checkpointjobs", stop_job(cluster_ns, s3_server, bucket))
        cluster_ns.wait("checkpointjobs", "move", phase("Succeeded"), timeout=90)
        # the placement rule: the next node in name order among the ready agents, never the node itself
        asked = {agent.node: agent.requests[-1].memory_copy for agent in (a, b)}
        assert {node: (t.node, t.address) for node, t in asked.items() if t} == {
            "node-a": ("node-b", f"{b.host}:{b.port}"),
            "node-b": ("node-c", f"{c.host}:{c.port}"),
        }
        assert not c.requests  # no pod of the job there: it only holds node-b's part
        # committed on S3 first: the copies are listed once their holders have them sealed
        status = cluster_ns.wait("checkpoints", "ring-c1", tiers(["S3", "Memory"]))["status"]
        assert status["readyToRestore"] is True
        assert [(m["part"], m["node"]) for m in status["memoryCopies"]] == [
            ("node-a", "node-b"),
            ("node-b", "node-c"),
        ]
        # as a user sees it
        described = kubectl_ibckpt(kube.kubeconfig, cluster_ns.namespace, "describe", "ring-c1", timeout=120)
        assert described.returncode == 0, described.stderr
        assert "Tiers:" in described.stdout and "S3, Memory" in described.stdout, described.stdout
        assert "node-a on node-b, node-b on node-c" in described.stdout, described.stdout

        # node-c's agent goes away: its copy is not offered, and that part is read from S3; both pods
        # come back on node-a
        cluster_ns.agent_pod_ready("node-c", ready=False)
        for name in ("ring-0", "ring-1"):
            cluster_ns.report_killed(name)
            cluster_ns.core.delete_namespaced_pod(name, cluster_ns.namespace, grace_period_seconds=0)
        back = {"apiVersion": API, "kind": "RestoreJob", "metadata": {"name": "back"},
                "spec": {"checkpointName": "ring-c1", "avoidNodes": ["node-b"]}}  # fmt: skip
        cluster_ns.create("restorejobs", back)
        body = cluster_ns.wait("restorejobs", "back", phase("Succeeded"), timeout=90)
        [request] = a.restores
        assert [(m.node, m.address, m.part) for m in request.memory_copies or []] == [
            ("node-b", f"{b.host}:{b.port}", "node-a")
        ]
        assert body["status"]["memoryReads"] == {"chunks": 1, "bytes": 1000, "holders": ["node-b"]}
        # an unready holder is not forgotten: it may still hold its copy
        status = (cluster_ns.get("checkpoints", "ring-c1") or {})["status"]
        assert status["tiers"] == ["S3", "Memory"] and len(status["memoryCopies"]) == 2

        # deleting the Checkpoint drops its copies where the holder is reachable, and says where not
        assert [c.checkpoint for c in b.shelf.listing().copies] == ["ring-c1"]
        cluster_ns.delete("checkpoints", "ring-c1")
        [dropped] = cluster_ns.wait_events("ring-c1", "MemoryCopiesDropped")
        assert "dropped on node-b, not on node-c (not reachable)" in dropped.message, dropped.message
        assert b.shelf.listing().copies == []


def test_copies_a_holder_lost_or_replaced_are_neither_read_nor_listed(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    # the pods of one workload, as a schedule checkpoints them: its checkpoints are one job in the store
    batch = kubernetes.client.BatchV1Api(cluster_ns.api)
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "ring:test"}]}}
    owner = batch.create_namespaced_job(
        cluster_ns.namespace, {"metadata": {"name": "ring"}, "spec": {"template": template, "suspend": True}}
    )
    ref = [{"apiVersion": "batch/v1", "kind": "Job", "name": "ring", "uid": owner.metadata.uid}]
    for agent, pod in ((a, "ring-0"), (b, "ring-1")):
        agent.register(cluster_ns.pod(pod, agent.node, RING, owners=ref), cluster_ns.namespace)
    cluster_ns.s3_secret(s3_server)
    with operator(memory_tier=True):
        for name in ("c1", "c2"):  # two LeaveRunning checkpoints of one job: each holder keeps the latest
            job = stop_job(cluster_ns, s3_server, bucket)
            job["metadata"]["name"] = name
            del job["spec"]["selector"]
            job["spec"] |= {"workloadRef": {"kind": "Job", "name": "ring"}, "mode": "LeaveRunning",
                            "checkpointName": f"ring-{name}"}  # fmt: skip
            cluster_ns.create("checkpointjobs", job)
            cluster_ns.wait("checkpointjobs", name, phase("Succeeded"), timeout=90)
        newer = cluster_ns.wait("checkpoints", "ring-c2", tiers(["S3", "Memory"]))["status"]
        assert [c.checkpoint for c in b.shelf.listing().copies] == ["ring-c2"]
        older = cluster_ns.wait("checkpoints", "ring-c1", tiers(["S3"]))
        assert "memoryCopies" not in older["status"]
        assert [(m["part"], m["node"]) for m in newer["memoryCopies"]] == [
            ("node-a", "node-b"),
            ("node-b", "node-a"),
        ]

        # node-a's agent restarted: it holds nothing now, so only node-b's copy is read
        a.restart_shelf()
        for pod in ("ring-0", "ring-1"):  # the job was lost: its pods are gone
            cluster_ns.core.delete_namespaced_pod(pod, cluster_ns.namespace, grace_period_seconds=0)
        back = {"apiVersion": API, "kind": "RestoreJob", "metadata": {"name": "back"},
                "spec": {"checkpointName": "ring-c2"}}  # fmt: skip
        cluster_ns.create("restorejobs", back)
        cluster_ns.wait("restorejobs", "back", phase("Succeeded"), timeout=90)
        sent = [(m.node, m.part) for agent in (a, b) for r in agent.restores for m in r.memory_copies or []]
        assert sorted(set(sent)) == [("node-b", "node-a")], sent
        status = (cluster_ns.get("checkpoints", "ring-c2") or {})["status"]
        assert status["tiers"] == ["S3"]
        assert [(m["part"], m["node"]) for m in status["memoryCopies"]] == [("node-a", "node-b")]


def test_without_the_tier_nothing_is_kept_in_memory(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    cluster_ns.rank_pod(a, "ring-0", RING)
    cluster_ns.rank_pod(b, "ring-1", RING)
    cluster_ns.s3_secret(s3_server)
    with operator():
        cluster_ns.create("checkpointjobs", stop_job(cluster_ns, s3_server, bucket))
        cluster_ns.wait("checkpointjobs", "move", phase("Succeeded"), timeout=90)
    assert [agent.requests[-1].memory_copy for agent in (a, b)] == [None, None]
    status = (cluster_ns.get("checkpoints", "ring-c1") or {})["status"]
    assert status["tiers"] == ["S3"] and "memoryCopies" not in status
