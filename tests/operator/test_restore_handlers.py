"""RestoreJob against the real apiserver and the real S3, with fake node agents (conftest.py): a Stop
checkpoint restored as new pods of the same names on the swapped nodes, the images staged before the
pods are created; a failed agent undoes the restore (a failed download creates no pod); an existing
pod, an incompatible node or one without the RDMA devices the pods used fails it before anything is
created; bad input."""

from __future__ import annotations

import os
import secrets
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ibckpt import formats
from ibckpt.agentapi import AgentFormats
from ibckpt.api.schedule import SCHEDULE_LABEL
from ibckpt.store import ImageStore, RankInfo, StoreConfig
from ibckpt.store.manifest import ContainerDevices
from testbed.s3 import S3Server
from testbed.status import phase

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.usefixtures("runtime_class")]
RESTORES = "restorejobs"
API = "ibckpt.io/v1alpha1"


def storage(s3: S3Server, bucket: str) -> dict[str, Any]:
    return {"endpoint": s3.endpoint, "region": s3.region, "bucket": bucket,
            "credentialsSecretRef": {"name": "s3-creds"}}  # fmt: skip


def creds(cluster: Cluster, s3: S3Server) -> None:
    cluster.s3_secret(s3)


def restore_job(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "RestoreJob", "metadata": {"name": name}, "spec": spec}


def warning(cluster: Cluster, name: str, reason: str) -> str:
    """The Warning Event's message (posted right after the status that names the failure)."""
    deadline = time.monotonic() + 10
    while True:
        found = [e for e in cluster.events(name) if e.type == "Warning" and e.reason == reason]
        if found:
            return str(found[0].message)
        assert time.monotonic() < deadline, f"no Warning Event {reason} on {name}"
        time.sleep(0.2)


def assert_failed(cluster: Cluster, body: dict[str, Any], reason: str, *words: str) -> None:
    status = body["status"]
    assert status["phase"] == "Failed" and status["reason"] == reason, status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == reason
    event = warning(cluster, body["metadata"]["name"], reason)
    for word in words:
        assert word in status["message"], status["message"]
        assert word in event, event


def source_pod(
    cluster: Cluster, name: str, node: str, host_ip: str = "", host_network: bool = False
) -> dict[str, Any]:
    """A job's pod as a user (or an MPI launcher) writes it: hostname and subdomain are its identity."""
    body = {
        "metadata": {"name": name, "labels": {"app": "ring", "rank": name[-1]},
                     "annotations": {"team": "solver"}},
        "spec": {
            "nodeName": node, "hostname": name, "subdomain": "ring", "runtimeClassName": "ibckpt",
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "ring:test",
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }  # fmt: skip
    if host_network:
        body["spec"]["hostNetwork"] = True
    created = cluster.core.create_namespaced_pod(cluster.namespace, body)
    status = {"phase": "Running", "podIP": host_ip if host_network else "10.1.0.9", "hostIP": host_ip or None,
              "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
    cluster.core.patch_namespaced_pod_status(name, cluster.namespace, {"status": status})
    return {"name": name, "uid": created.metadata.uid, "node": node}


def commit_checkpoint(config: StoreConfig, job: str, checkpoint_id: str, nodes: list[str]) -> str:
    """A committed checkpoint in the real S3 (each node's part staged as the agents stage theirs)."""
    store = ImageStore.open(config)
    for index, node in enumerate(nodes):
        images = Path(f"/tmp/ibckpt-restore-test-{secrets.token_hex(3)}")
        images.mkdir()
        (images / "pages-1.img").write_bytes(os.urandom(10_000))
        with store.writer(job, checkpoint_id) as writer:
            writer.add_tree(images, under=node)
            writer.stage(node, ranks=[RankInfo(rank=index, pod=node, node=node, root=node)])
    manifest = store.commit_parts(job, checkpoint_id, nodes)
    return store.context.layout.manifest_key(manifest.ref)


def checkpoint(
    name: str, location: dict[str, Any], pods: list[tuple[str, str]], requires: dict[str, Any] | None = None,
    manifest_key: str = "ibckpt/v1/manifests/x/ring/c1.json", job: str = "ns/ring", checkpoint_id: str = "c1",
) -> dict[str, Any]:  # fmt: skip
    """A Checkpoint as the operator publishes it (templates and rank keys recorded)."""
    recorded = [
        {"name": pod, "uid": f"old-{pod}", "node": node, "ranks": [f"ring/{pod}/main/1"],
         "template": {"labels": {"app": "ring"}, "spec": {"hostname": pod, "subdomain": "ring",
                      "restartPolicy": "Never", "containers": [{"name": "main", "image": "ring:test"}]}}}
        for pod, node in pods
    ]  # fmt: skip
    spec = {"manifestKey": manifest_key, "storage": location, "jobName": job, "checkpointId": checkpoint_id,
            "mode": "Stop", "pods": recorded}  # fmt: skip
    if requires:
        spec["requires"] = requires
    return {"apiVersion": API, "kind": "Checkpoint", "metadata": {"name": name,
            "annotations": {"ibckpt.io/retain-images": "true"}}, "spec": spec}  # fmt: skip


def pods_of(cluster: Cluster) -> dict[str, Any]:
    return {p.metadata.name: p for p in cluster.core.list_namespaced_pod(cluster.namespace).items}


def test_a_stop_checkpoint_is_restored_as_the_same_pods_on_the_swapped_nodes(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    # the pods were started before a shim upgrade: they map build d..., the nodes' current one is e...;
    # the checkpoint records the build they map, and the nodes keep it, so the restore is admitted
    a.shim_sha256 = b.shim_sha256 = "e" * 64
    a.shim_builds = b.shim_builds = ["d" * 64, "e" * 64]
    # ring-0 shares its node's network (as MPI jobs on RoCE often do): its TCP connections name node-a's
    # address, which the restore on node-b must map to node-b's; ring-1's pod IP is its own
    sources = {"ring-0": source_pod(cluster_ns, "ring-0", "node-a", a.host, host_network=True),
               "ring-1": source_pod(cluster_ns, "ring-1", "node-b", b.host)}  # fmt: skip
    a.register(sources["ring-0"], cluster_ns.namespace, shim_build="d" * 64)
    b.register(sources["ring-1"], cluster_ns.namespace, shim_build="d" * 64)
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    move = {"apiVersion": API, "kind": "CheckpointJob", "metadata": {"name": "move"},
            "spec": {"selector": {"matchLabels": {"app": "ring"}}, "storage": storage(s3_server, bucket),
                     "mode": "Stop", "checkpointName": "ring-c1"}}  # fmt: skip
    with operator():
        cluster_ns.create("checkpointjobs", move)
        cluster_ns.wait("checkpointjobs", "move", phase("Succeeded"), timeout=90)
        recorded = cluster_ns.get("checkpoints", "ring-c1")
        assert recorded is not None
        spec = recorded["spec"]
        by_name = {p["name"]: p for p in spec["pods"]}
        # What the restore needs was recorded: the rank keys the agents reported, each pod's template.
        assert by_name["ring-0"]["ranks"] == [f"move/{sources['ring-0']['uid']}/main/0"]
        template = by_name["ring-1"]["template"]
        assert template["spec"]["hostname"] == "ring-1" and template["spec"]["subdomain"] == "ring"
        assert "nodeName" not in template["spec"] and template["annotations"] == {"team": "solver"}
        # the formats the agents reported writing: what a later release's agent must read to restore it
        assert spec["requires"] == {"ibckpt": "test", "formats": dict(formats.WRITES), "shim": "d" * 64}
        assert spec["rankCount"] == 2
        assert (by_name["ring-0"]["hostIP"], by_name["ring-1"]["hostIP"]) == (a.host, b.host)

        # The sources were deleted by the Stop job (Terminating: no kubelet here); play the kubelet: ring-1
        # is reported killed but not cleaned up yet, and the restore removes it itself; ring-0's kubelet
        # still reports it running when the restore comes, so the restore waits for its name.
        cluster_ns.report_killed("ring-1")
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1", avoidSourceNodes=True))
        [waiting] = cluster_ns.wait_events("back", "WaitingForSource")
        assert waiting.message.startswith(f"pod ring-0 (uid {sources['ring-0']['uid']}), checkpointed, is "
                                          "being deleted: waiting up to 50s"), waiting.message  # fmt: skip
        time.sleep(2)
        assert (cluster_ns.get(RESTORES, "back") or {})["status"].get("phase") in ("Pending", "Admitted")
        cluster_ns.core.delete_namespaced_pod("ring-0", ns, grace_period_seconds=0)
        body = cluster_ns.wait(RESTORES, "back", phase("Succeeded"), timeout=90)

    status = body["status"]
    created = pods_of(cluster_ns)
    assert sorted(created) == ["ring-0", "ring-1"]
    swapped = {"ring-0": "node-b", "ring-1": "node-a"}
    for name, pod in created.items():
        assert pod.metadata.uid != sources[name]["uid"]
        assert pod.spec.node_name == swapped[name] and pod.spec.runtime_class_name == "ibckpt"
        assert (pod.spec.hostname, pod.spec.subdomain) == (name, "ring")
        assert pod.metadata.annotations["ibckpt.io/restore-from"] == f"{ns}/ring-c1"
        assert pod.metadata.annotations["team"] == "solver"
        assert pod.metadata.labels == {"app": "ring", "rank": name[-1]}
        assert [v.name for v in pod.spec.volumes or []][:1] == ["scratch"]
        # A bare source pod: the restored one belongs to the RestoreJob (docs/operator.md).
        [owner] = pod.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid) == ("RestoreJob", "back", body["metadata"]["uid"])
    rows = {row["name"]: row for row in status["pods"]}
    for name, pod in created.items():
        assert rows[name]["uid"] == pod.metadata.uid and rows[name]["node"] == swapped[name]
        assert rows[name]["phase"] == "Resumed"
    run = status["attempt"].rpartition("-")[0]
    for agent, pod in ((a, "ring-1"), (b, "ring-0")):  # each node restores the pod placed on it
        [request] = agent.restores
        assert request.session_id == f"rsj-{run}" and request.coordinator.startswith("127.0.0.1:")
        assert request.checkpoint == f"{ns}/ring-c1" and request.job == "move"
        assert (request.images.job, request.images.checkpoint_id) == (spec["jobName"], spec["checkpointId"])
        assert request.images.credentials.name == "s3-creds"
        assert request.remap_ip == {a.host: b.host}  # one map for all: ring-0's node address moved
        [rank] = request.ranks
        # Asked before the pod existed (the images are staged first): by namespace and name, no uid.
        assert agent.pods_at_request == [[]]
        assert rank.pod_uid == "" and rank.container == "main"
        assert rank.rank_key == by_name[pod]["ranks"][0] and (rank.namespace, rank.pod) == (ns, pod)
        assert request.session_token.get_secret_value() not in str(body)
        [reported] = agent.reports[request.session_id].ranks  # the agent found the pod created after
        assert reported.pod_uid == created[pod].metadata.uid
    reasons = [e.reason for e in cluster_ns.events("back")]
    for expected in ("WaitingForSource", "SourceRemoved", "Downloading", "Restoring", "Rebuilding",
                     "Resuming", "Succeeded"):  # fmt: skip
        assert expected in reasons, reasons
    [removed] = [e.message for e in cluster_ns.events("back") if e.reason == "SourceRemoved"]
    assert removed.startswith("source pod ring-1 had ended"), removed
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "True"
    # the driver wrote where the time went: every phase the restore left, in order
    timings = status["phaseTimings"]
    assert [t["phase"] for t in timings] == [
        "Pending", "Admitted", "Downloading", "Restoring", "Rebuilding", "Resuming",
    ]  # fmt: skip
    assert timings[0]["startedAt"] == status["startTime"] and all(t["seconds"] >= 0 for t in timings)


def two_agents_and_a_checkpoint(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, store_config: Any
) -> tuple[Any, Any]:
    """Agents on node-a and node-b, and a committed two-pod Checkpoint `ring-c1` (ring-0 on node-a,
    ring-1 on node-b) in S3 and in the API."""
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, store=config)
    b = agents.add(cluster_ns, "node-b", 2, store=config)
    creds(cluster_ns, s3_server)
    key = commit_checkpoint(config, f"{cluster_ns.namespace}/ring", "c1", ["node-a", "node-b"])
    pods = [("ring-0", "node-a"), ("ring-1", "node-b")]
    body = checkpoint("ring-c1", storage(s3_server, bucket), pods, manifest_key=key,
                      job=f"{cluster_ns.namespace}/ring")  # fmt: skip
    cluster_ns.create("checkpoints", body)
    return a, b


def failed_restore(cluster_ns: Cluster, operator: Any) -> Any:
    """Restore ring-c1 as RestoreJob `back` and wait for it to fail."""
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        return cluster_ns.wait(RESTORES, "back", phase("Failed"), timeout=90)


def test_a_failed_agent_fails_the_restore_and_deletes_the_pods_it_created(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    a, b = two_agents_and_a_checkpoint(cluster_ns, s3_server, bucket, agents, store_config)
    b.restore_failure = "node-b: criu restore of ring/ring-1/main/1: pid 4242 is in use"
    body = failed_restore(cluster_ns, operator)
    assert_failed(cluster_ns, body, "AgentFailed", "pid 4242 is in use")
    status = body["status"]
    assert status["failedFrom"] == "Restoring"  # the pods existed: node-b failed restoring its own
    assert [row["phase"] for row in status["pods"]] == ["Removed", "Removed"]
    # No half-restored job: both created pods are deleted (Terminating here: no kubelet), by uid.
    created = pods_of(cluster_ns)
    assert sorted(created) == ["ring-0", "ring-1"]
    for pod in created.values():
        assert pod.metadata.deletion_timestamp is not None
        assert pod.metadata.uid in {row["uid"] for row in status["pods"]}
    session = a.restores[0].session_id
    assert session in [s for s, _ in a.aborts]  # the node that was doing fine was told to stop
    assert "pid 4242 is in use" in a.aborts[0][1]


def test_an_operator_restart_while_restoring_removes_the_pods_it_created(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """The agents joined a coordinator session that died with the operator: the new one cannot carry it
    on, so it aborts the agents' session and deletes the pods by the uids status recorded."""
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, store=config)
    a.restore_hang = True
    creds(cluster_ns, s3_server)
    key = commit_checkpoint(config, f"{cluster_ns.namespace}/ring", "c1", ["node-a"])
    body = checkpoint("ring-c1", storage(s3_server, bucket), [("ring-0", "node-a")], manifest_key=key,
                      job=f"{cluster_ns.namespace}/ring")  # fmt: skip
    cluster_ns.create("checkpoints", body)
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        before = cluster_ns.wait(
            RESTORES,
            "back",
            lambda o: phase("Restoring")(o) and o["status"]["pods"][0].get("uid"),
            timeout=60,
        )  # the images staged, the pod created: the agent waits for the runtime to restore it
    [row] = before["status"]["pods"]
    assert row["uid"] == pods_of(cluster_ns)["ring-0"].metadata.uid  # in status before the operator left
    with operator():
        after = cluster_ns.wait(RESTORES, "back", phase("Failed"), timeout=60)
    assert_failed(cluster_ns, after, "OperatorRestarted", "outcome is unknown")
    assert after["status"]["failedFrom"] == "Restoring"
    pod = pods_of(cluster_ns)["ring-0"]
    assert pod.metadata.uid == row["uid"] and pod.metadata.deletion_timestamp is not None
    run = before["status"]["attempt"].rpartition("-")[0]
    assert [s for s, _ in a.aborts] == [f"rsj-{run}"] and len(a.restores) == 1  # never sent again


def test_a_failed_download_fails_the_restore_before_any_pod_is_created(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    a, b = two_agents_and_a_checkpoint(cluster_ns, s3_server, bucket, agents, store_config)
    b.download_failure = "node-b: fetching ring/node-b/pages-1.img: SlowDown"
    body = failed_restore(cluster_ns, operator)
    assert_failed(cluster_ns, body, "AgentFailed", "SlowDown")
    status = body["status"]
    assert status["failedFrom"] == "Downloading"
    assert [(row["phase"], row.get("uid")) for row in status["pods"]] == [("Removed", None)] * 2
    assert not pods_of(cluster_ns)  # nothing was created: the pods come only once the images are staged
    assert [s for s, _ in a.aborts] == [a.restores[0].session_id]  # node-a unstages what it staged
    assert "SlowDown" in a.aborts[0][1]


def test_an_existing_pod_of_the_same_name_fails_before_anything_is_created(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    a = agents.add(cluster_ns, "node-a", 1)
    agents.add(cluster_ns, "node-b", 2)
    source = source_pod(cluster_ns, "ring-0", "node-a")  # never deleted
    before = cluster_ns.core.read_namespaced_pod("ring-0", cluster_ns.namespace).metadata.resource_version
    creds(cluster_ns, s3_server)
    location = storage(s3_server, bucket)
    cluster_ns.create(
        "checkpoints",
        checkpoint(
            "ring-c1",
            location,
            [("ring-1", "node-b"), ("ring-0", "node-a")],
            job=f"{cluster_ns.namespace}/ring",
        ),
    )
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        body = cluster_ns.wait(RESTORES, "back", phase("Failed"))
    assert_failed(cluster_ns, body, "PodExists", "pod ring-0 already exists", "delete the source pod first")
    assert body["status"]["failedFrom"] == "Pending"
    pods = pods_of(cluster_ns)
    assert list(pods) == ["ring-0"]  # ring-1, admitted first, was not created either
    assert pods["ring-0"].metadata.uid == source["uid"]
    assert pods["ring-0"].metadata.resource_version == before
    assert not a.restores and not any(agent.restores for agent in agents.by_node.values())


def test_an_incompatible_node_fails_before_anything_is_created(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    old = agents.add(cluster_ns, "node-old", 5)
    old.version = "0.2.0"
    reads = AgentFormats.this_release().reads
    old.formats = AgentFormats(writes={**formats.WRITES, "restore": 2}, reads={**reads, "restore": [2]})
    old.shim_sha256 = "b" * 64  # another shim build than the checkpoint's processes mapped
    cluster_ns.core.patch_node_status(
        "node-old", {"status": {"nodeInfo": {"kernelVersion": "5.10.0-28-amd64"}}}
    )
    creds(cluster_ns, s3_server)
    required = {"ibckpt": "0.1.0", "kernel": "6.1.0-13-amd64", "criu": "4.1", "formats": dict(formats.WRITES),
                "shim": "a" * 64}  # fmt: skip
    location = storage(s3_server, bucket)
    cluster_ns.create(
        "checkpoints",
        checkpoint(
            "ring-c1", location, [("ring-0", "node-old")], required, job=f"{cluster_ns.namespace}/ring"
        ),
    )
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        body = cluster_ns.wait(RESTORES, "back", phase("Failed"))
    assert_failed(
        cluster_ns, body, "IncompatibleNode", "node node-old cannot restore pod ring-0",
        "the checkpoint's restore record format is 1, its agent reads 2 (ibckpt 0.2.0)",
        "it does not keep shim build aaaaaaaaaaaa, which the checkpoint's processes mapped",
        "its kernel is 5.10.0-28-amd64, the checkpoint needs 6.1.0-13-amd64",
    )  # fmt: skip
    assert "ibckpt agent is 0.2.0" not in body["status"]["message"]  # the version is not what refused
    assert not pods_of(cluster_ns) and not old.restores
    assert any(e.reason == "VersionsNotChecked" and "criu" in e.message for e in cluster_ns.events("back"))


def test_a_checkpoint_of_an_older_minor_release_restores_when_its_formats_are_read(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """Taken by 0.1.0 in this release's formats, restored by agents of 0.2.0 that read them."""
    config = store_config(bucket)
    for node, index in (("node-a", 1), ("node-b", 2)):
        agent = agents.add(cluster_ns, node, index, "complete", config)
        agent.version, agent.shim_sha256 = "0.2.0", "c" * 64  # the same shim build: the upgrade kept it
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    key = commit_checkpoint(config, f"{ns}/ring", "c1", ["node-a", "node-b"])
    required = {"ibckpt": "0.1.0", "formats": dict(formats.WRITES), "shim": "c" * 64}
    pods = [("ring-0", "node-a"), ("ring-1", "node-b")]
    cluster_ns.create("checkpoints", checkpoint("ring-c1", storage(s3_server, bucket), pods, required,
                                                manifest_key=key, job=f"{ns}/ring"))  # fmt: skip
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        done = cluster_ns.wait(RESTORES, "back", phase("Succeeded"), timeout=90)
    assert done["status"]["phase"] == "Succeeded"
    assert sorted(pods_of(cluster_ns)) == ["ring-0", "ring-1"]


def test_the_pods_are_created_while_the_last_bytes_of_a_slow_download_arrive(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """Each agent's download takes 8 s at a steady rate: once both expect to end within the lead
    (machine/restore.py, "Overlap"), the pods are created while they still download."""
    a, b = two_agents_and_a_checkpoint(cluster_ns, s3_server, bucket, agents, store_config)
    a.staging_seconds = b.staging_seconds = 8.0
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        done = cluster_ns.wait(RESTORES, "back", phase("Succeeded"), timeout=90)
    assert sorted(pods_of(cluster_ns)) == ["ring-0", "ring-1"]
    for agent in (a, b):
        # the pods existed before the download ended, not before it began
        early = [seconds for seconds, created in agent.staging_seen if created and seconds < 8.0]
        assert early, agent.staging_seen
        assert not agent.staging_seen[0][1]
    [creating] = [e.message for e in cluster_ns.events("back") if e.reason == "CreatingPods"]
    assert (
        creating.startswith("every node expects its images staged within ")
        and "creating the pods" in creating
    )
    assert [row["phase"] for row in done["status"]["pods"]] == ["Resumed", "Resumed"]


def test_a_restore_waits_its_turn_on_a_node_whose_agent_restores_another_job(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """An agent runs one session at a time: two drains moving jobs onto one node meet there. The later
    restore waits for the node within agent_busy_wait_seconds, says so, and fails only past that."""
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    key = commit_checkpoint(config, f"{ns}/ring", "c1", ["node-a", "node-b"])
    pods = [("ring-0", "node-a"), ("ring-1", "node-b")]
    cluster_ns.create("checkpoints", checkpoint("ring-c1", storage(s3_server, bucket), pods,
                                                manifest_key=key, job=f"{ns}/ring"))  # fmt: skip
    b.busy_with = "rsj-other-job"
    with operator(agent_busy_wait_seconds=3.0):  # a bound that runs out
        cluster_ns.create(RESTORES, restore_job("early", checkpointName="ring-c1"))
        early = cluster_ns.wait(RESTORES, "early", phase("Failed"), timeout=60)
    assert_failed(cluster_ns, early, "AgentBusy", "node node-b: ", "busy with session 'rsj-other-job'",
                  "after waiting up to 3s")  # fmt: skip
    assert not b.restores and not pods_of(cluster_ns)
    assert [session for session, _ in a.aborts] == [a.restores[0].session_id]  # node-a's was taken back

    with operator():
        cluster_ns.create(RESTORES, restore_job("back", checkpointName="ring-c1"))
        [waiting] = cluster_ns.wait_events("back", "WaitingForAgent")
        assert waiting.type == "Normal", waiting
        busy = "node-b is busy with session 'rsj-other-job'; waiting up to 600s"
        assert waiting.message.startswith("node node-b: ") and busy in waiting.message, waiting.message
        time.sleep(3)  # asked again meanwhile: still waiting, nothing failed
        assert (cluster_ns.get(RESTORES, "back") or {})["status"]["phase"] == "Downloading"
        b.busy_with = None  # the other job's restore ended
        done = cluster_ns.wait(RESTORES, "back", phase("Succeeded"), timeout=90)
    assert done["status"]["phase"] == "Succeeded" and len(b.restores) == 1
    assert sorted(pods_of(cluster_ns)) == ["ring-0", "ring-1"]


def test_restore_job_bad_input(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    agents.add(cluster_ns, "node-a", 1)
    creds(cluster_ns, s3_server)
    location = storage(s3_server, bucket)
    ns = cluster_ns.namespace
    cluster_ns.create("checkpoints", checkpoint("old", location, [("ring-0", "node-a")], job=f"{ns}/ring"))
    unrecorded = checkpoint("older", location, [("ring-0", "node-a")], job=f"{ns}/ring")
    del unrecorded["spec"]["pods"][0]["template"]
    cluster_ns.create("checkpoints", unrecorded)
    # someone who may write Checkpoints here points one at another namespace's images
    cluster_ns.create(
        "checkpoints", checkpoint("theirs", location, [("ring-0", "node-a")], job="other-team/ring")
    )
    with operator():
        cluster_ns.create(RESTORES, restore_job("missing", checkpointName="nope"))
        cluster_ns.create(RESTORES, restore_job("offnode", checkpointName="old", avoidSourceNodes=True))
        cluster_ns.create(RESTORES, restore_job("notemplate", checkpointName="older"))
        missing = cluster_ns.wait(RESTORES, "missing", phase("Failed"))
        offnode = cluster_ns.wait(RESTORES, "offnode", phase("Failed"))
        notemplate = cluster_ns.wait(RESTORES, "notemplate", phase("Failed"))
        cluster_ns.create(RESTORES, restore_job("foreign", checkpointName="theirs"))
        foreign = cluster_ns.wait(RESTORES, "foreign", phase("Failed"))
    assert_failed(cluster_ns, missing, "CheckpointNotFound", "nope")
    assert_failed(cluster_ns, offnode, "NoNodeAvailable", "ring-0")
    assert_failed(cluster_ns, notemplate, "CheckpointNotRestorable", "no pod template for ring-0")
    assert_failed(cluster_ns, foreign, "ForeignCheckpoint", "job other-team/ring", f"not in namespace {ns}")
    assert not any(agent.restores for agent in agents.by_node.values())
    assert not pods_of(cluster_ns)


def test_latest_of_a_schedule_binds_the_newest_restorable_checkpoint_and_restores_it(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    ns, config = cluster_ns.namespace, store_config(bucket)
    agents.add(cluster_ns, "node-a", 1, "complete", config)
    agents.add(cluster_ns, "node-b", 2, "complete", config)
    cluster_ns.s3_secret(s3_server)
    location = storage(s3_server, bucket)
    committed = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    key = commit_checkpoint(config, f"{ns}/ring", "c1", ["node-a", "node-b"])
    pods = [("ring-0", "node-a"), ("ring-1", "node-b")]
    for name, minutes in (("ring-c1", 1), ("ring-c2", 2), ("ring-c3", 3)):
        body = checkpoint(name, location, pods, manifest_key=key, job=f"{ns}/ring")
        body["metadata"]["labels"] = {SCHEDULE_LABEL: "nightly"}
        body["spec"]["committedTime"] = (committed + timedelta(minutes=minutes)).isoformat()
        if name == "ring-c2":  # recorded by an operator that kept no templates
            del body["spec"]["pods"][1]["template"]
        cluster_ns.create("checkpoints", body)
    cluster_ns.patch_status(
        "checkpoints", "ring-c3", {"readyToRestore": False, "message": "manifest missing"}
    )

    with operator():
        cluster_ns.create(RESTORES, restore_job("latest", latestOf={"schedule": "nightly"}))
        cluster_ns.create(RESTORES, restore_job("nothing", latestOf={"schedule": "weekly"}))
        done = cluster_ns.wait(RESTORES, "latest", phase("Succeeded"), timeout=90)
        nothing = cluster_ns.wait(RESTORES, "nothing", phase("Failed"), timeout=60)

    assert done["spec"]["checkpointName"] == "ring-c1", done["spec"]
    skipped = done["status"]["skippedCheckpoints"]
    assert [s["name"] for s in skipped] == ["ring-c3", "ring-c2"], skipped
    assert "manifest missing" in skipped[0]["reason"] and "no pod template for ring-1" in skipped[1]["reason"]
    [chosen] = [e.message for e in cluster_ns.events("latest") if e.reason == "CheckpointChosen"]
    assert "ring-c1" in chosen and "schedule nightly" in chosen and "ring-c3, ring-c2" in chosen, chosen
    restored = {p.metadata.name: p for p in cluster_ns.core.list_namespaced_pod(ns).items}
    assert sorted(restored) == ["ring-0", "ring-1"]
    assert restored["ring-0"].metadata.annotations["ibckpt.io/restore-from"] == f"{ns}/ring-c1"

    status = nothing["status"]
    assert status["reason"] == "NoRestorableCheckpoint", status
    assert "no Checkpoint of schedule weekly exists" in status["message"], status
    assert "checkpointName" not in nothing["spec"]
    assert any(
        e.reason == "NoRestorableCheckpoint" and e.type == "Warning" for e in cluster_ns.events("nothing")
    )


# -- RDMA devices (docs/rdma-pods.md): refused before any pod when the destination's do not fit


def commit_two_rail_checkpoint(config: StoreConfig, job: str) -> str:
    """ring-0, checkpointed on node-a, whose rank used two HCAs (multi-rail)."""
    store = ImageStore.open(config)
    images = Path(f"/tmp/ibckpt-devices-test-{secrets.token_hex(3)}")
    images.mkdir()
    (images / "pages-1.img").write_bytes(os.urandom(10_000))
    used = ContainerDevices(allocated=["mlx5_0", "mlx5_1"], used={"ring/ring-0/main/1": ["mlx5_0", "mlx5_1"]})
    with store.writer(job, "c1") as writer:
        writer.add_tree(images, under="node-a/ring-0.main")
        writer.stage("node-a", ranks=[RankInfo(rank=0, pod="ring-0", node="node-a", root="node-a/ring-0.main",
                                               devices=used)])  # fmt: skip
    manifest = store.commit_parts(job, "c1", ["node-a"])
    return store.context.layout.manifest_key(manifest.ref)


@pytest.mark.parametrize("device_map", [None, {"mlx5_0": "rxe9"}], ids=["by-count", "explicit-target"])
def test_a_pod_whose_devices_do_not_fit_its_node_is_refused_before_any_pod_exists(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any,
    device_map: dict[str, str] | None,
) -> None:  # fmt: skip
    config = store_config(bucket)
    one_hca = agents.add(cluster_ns, "node-b", 2, "complete", config)
    one_hca.rdma_devices = ["rxe0"]
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    key = commit_two_rail_checkpoint(config, f"{ns}/ring")
    cluster_ns.create("checkpoints", checkpoint("ring-c1", storage(s3_server, bucket), [("ring-0", "node-a")],
                                                manifest_key=key, job=f"{ns}/ring"))  # fmt: skip
    spec: dict[str, Any] = {"checkpointName": "ring-c1"}
    if device_map:
        spec["deviceMap"] = device_map
    with operator():
        cluster_ns.create(RESTORES, restore_job("back", **spec))
        body = cluster_ns.wait(RESTORES, "back", phase("Failed"), timeout=60)
    why = (
        "the deviceMap names rxe9, not among the node's rxe0"
        if device_map
        else "its ranks used 2 RDMA devices (mlx5_0, mlx5_1), the node has 1 (rxe0)"
    )
    assert_failed(
        cluster_ns, body, "DevicesDoNotFit", "node node-b cannot take the RDMA devices of pod ring-0",
        f"container ring-0.main: {why}",
    )  # fmt: skip
    assert not pods_of(cluster_ns) and not one_hca.restores


def test_a_node_with_enough_devices_restores_a_renamed_pair(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """Two HCAs of other names: the operator admits the pod (the agent maps them by position), and the
    agent is asked with the RestoreJob's deviceMap."""
    config = store_config(bucket)
    two_hcas = agents.add(cluster_ns, "node-b", 2, "complete", config)
    two_hcas.rdma_devices = ["rxe0", "rxe1"]
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    key = commit_two_rail_checkpoint(config, f"{ns}/ring")
    cluster_ns.create("checkpoints", checkpoint("ring-c1", storage(s3_server, bucket), [("ring-0", "node-a")],
                                                manifest_key=key, job=f"{ns}/ring"))  # fmt: skip
    with operator():
        cluster_ns.create(
            RESTORES, restore_job("back", checkpointName="ring-c1", deviceMap={"mlx5_0": "rxe1"})
        )
        done = cluster_ns.wait(RESTORES, "back", phase("Succeeded"), timeout=90)
    assert done["status"]["phase"] == "Succeeded"
    assert sorted(pods_of(cluster_ns)) == ["ring-0"]
    assert [r.device_map for r in two_hcas.restores] == [{"mlx5_0": "rxe1"}]
