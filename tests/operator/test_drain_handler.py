"""Drain protection against the real apiserver (v1.20) and the real S3, with fake node agents: the PDB,
the Node watch (a cordon), the Stop migration of the whole job, the release, the RestoreJob, the eviction
webhook served by kopf in the operator (the apiserver calls it on 127.0.0.1) and, with the webhook off, the
PDB answering instead; a failed checkpoint under each onFailure policy.

No kubelet runs here: killed pods stay Terminating, and the RestoreJob is whatever the restore driver makes
of fake agents. The two-node drain of issue 17 (kubectl drain, real agents) is the cluster test's."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import kubernetes
import pytest

from ibckpt.api import GROUP, VERSION
from testbed.ports import free_port
from testbed.s3 import S3Server

Agents = Cluster = Any  # conftest.py's fixtures
pytestmark = [pytest.mark.kube, pytest.mark.s3]
SCHEDULES, JOBS = "checkpointschedules", "checkpointjobs"


def protect(name: str, labels: dict[str, str], where: dict[str, Any], **drain: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointSchedule",
        "metadata": {"name": name},
        "spec": {"drain": drain, "template": {"selector": {"matchLabels": labels}, "storage": where}},
    }


def drain_phase(*wanted: str) -> Any:
    return lambda body: (body.get("status") or {}).get("drainPhase") in wanted


def wait_gone(cluster: Cluster, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while cluster.pdb(name) is not None:
        assert time.monotonic() < deadline, f"PDB {name} is still there"
        time.sleep(0.3)


def evict(cluster: Cluster, pod: str) -> tuple[int, str]:
    """POST pods/<pod>/eviction (policy/v1beta1 on 1.20): the HTTP status and the message."""
    body = {
        "apiVersion": "policy/v1beta1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": cluster.namespace},
    }
    try:
        cluster.core.create_namespaced_pod_eviction(pod, cluster.namespace, body)
    except kubernetes.client.ApiException as exc:
        return exc.status, str(json.loads(exc.body).get("message"))
    return 201, ""


def wait_requests(*agents: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(agent.requests for agent in agents):
        assert time.monotonic() < deadline, "the agents were never asked"
        time.sleep(0.2)


def finish_deletion(cluster: Cluster, *pods: str) -> None:
    """What the kubelet does for a killed pod: once it is Terminating, remove it."""
    for name in pods:
        deadline = time.monotonic() + 60
        while cluster.core.read_namespaced_pod(name, cluster.namespace).metadata.deletion_timestamp is None:
            assert time.monotonic() < deadline, f"{name} was never killed"
            time.sleep(0.2)
        cluster.core.delete_namespaced_pod(name, cluster.namespace, grace_period_seconds=0)


def wait_pod_gone(cluster: Cluster, name: str) -> None:
    deadline = time.monotonic() + 60
    while any(p.metadata.name == name for p in cluster.core.list_namespaced_pod(cluster.namespace).items):
        assert time.monotonic() < deadline, f"{name} is still there"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def cleanup(cluster_ns: Cluster) -> Any:
    """No schedule of a test may run under the next test's operator; nodes go back to schedulable."""
    yield
    cluster_ns.drop_all(SCHEDULES)
    for node in ("node-a", "node-b"):
        try:
            cluster_ns.core.patch_node(node, {"spec": {"unschedulable": None}})
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def webhook_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBCKPT_WEBHOOK", "on")
    monkeypatch.setenv("IBCKPT_WEBHOOK_HOST", "127.0.0.1")
    monkeypatch.setenv("IBCKPT_WEBHOOK_BIND", "127.0.0.1")
    monkeypatch.setenv("IBCKPT_WEBHOOK_PORT", str(free_port()))


def webhook_configured(cluster: Cluster, timeout: float = 60) -> None:
    api = kubernetes.client.AdmissionregistrationV1Api(cluster.api)
    deadline = time.monotonic() + timeout
    while True:
        try:
            hooks = api.read_validating_webhook_configuration("ibckpt.io").webhooks or []
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            hooks = []
        rules = [rule for hook in hooks for rule in hook.rules or ()]
        if any("pods/eviction" in rule.resources for rule in rules):
            break
        assert time.monotonic() < deadline, "the operator never configured the eviction webhook"
        time.sleep(0.3)
    # Fail open, time out fast, skip the namespaces labelled off: for both (the creation webhook sees
    # every pod creation in the cluster).
    [creation] = api.read_mutating_webhook_configuration("ibckpt.io").webhooks
    [eviction] = hooks
    assert (eviction.timeout_seconds, creation.timeout_seconds) == (10, 5)
    for hook in (eviction, creation):
        assert hook.failure_policy == "Ignore"
        [skip] = hook.namespace_selector.match_expressions
        assert (skip.key, skip.operator, skip.values) == ("ibckpt.io/admission", "NotIn", ["off"])
    assert creation.client_config.url.endswith(":" + os.environ["IBCKPT_WEBHOOK_PORT"] + "/restore-binding")


def test_cordon_migrates_the_whole_job_while_the_webhook_holds_evictions(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
    webhook_on: None,
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "hang", config)
    b = agents.add(cluster_ns, "node-b", 2, "hang", config)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(b, "ring-1", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    where, ns = cluster_ns.s3_location(s3_server, bucket), cluster_ns.namespace
    with operator() as handle:
        schedule = cluster_ns.create(SCHEDULES, protect("ring", {"app": "ring"}, where, deadlineSeconds=300))
        body = cluster_ns.wait(
            SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("protectedBy") is not None
        )
        # policy/v1 is not served by v1.20: discovery picks v1beta1.
        assert body["status"]["protectedBy"] == "policy/v1beta1/ibckpt-ring"
        assert body["status"]["drainPhase"] == "Idle"
        budget = cluster_ns.pdb("ibckpt-ring")
        assert budget is not None and budget["spec"]["maxUnavailable"] == 0
        assert budget["spec"]["selector"] == {"matchLabels": {"app": "ring"}}
        assert budget["metadata"]["ownerReferences"][0]["uid"] == schedule["metadata"]["uid"]
        webhook_configured(cluster_ns)

        cluster_ns.core.patch_node("node-a", {"spec": {"unschedulable": True}})
        body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Holding", "Checkpointing"))
        assert body["status"]["drainNodes"] == ["node-a"]
        assert body["status"]["migration"]["checkpointJob"] == "ring-drain-1"
        assert sorted(s["name"] for s in body["status"]["migration"]["sources"]) == ["ring-0", "ring-1"]
        held = cluster_ns.wait_events("ring", "DrainHeld")[0]
        assert held.type == "Warning" and "node-a" in held.message
        job = cluster_ns.get(JOBS, "ring-drain-1")
        assert (
            job is not None
            and job["spec"]["mode"] == "Stop"
            and job["spec"]["checkpointName"] == "ring-drain-1"
        )
        assert job["metadata"]["ownerReferences"][0]["uid"] == schedule["metadata"]["uid"]

        # The webhook answers (the PDB would say "disruption budget"): 429, why, and for how long.
        status, message = evict(cluster_ns, "ring-1")
        assert status == 429, message
        assert (
            "checkpointing ring before it leaves node-a" in message
            and "left of the migration deadline" in message
        )
        text = handle.metrics()
        assert f'ibckpt_drain_held{{schedule="{ns}/ring"}} 1.0' in text
        # A namespace labelled off is not sent to the webhook: there the PDB answers.
        cluster_ns.core.patch_namespace(ns, {"metadata": {"labels": {"ibckpt.io/admission": "off"}}})
        deadline = time.monotonic() + 30
        while "disruption budget" not in (answer := evict(cluster_ns, "ring-1"))[1]:
            assert time.monotonic() < deadline, f"the webhook still answers: {answer}"
            time.sleep(0.5)
        assert answer[0] == 429, answer
        cluster_ns.core.patch_namespace(ns, {"metadata": {"labels": {"ibckpt.io/admission": None}}})
        deadline = time.monotonic() + 30
        while "checkpointing ring" not in (answer := evict(cluster_ns, "ring-1"))[1]:
            assert time.monotonic() < deadline, f"the webhook never answered again: {answer}"
            time.sleep(0.5)

        # Every pod of the job is checkpointed (not only node-a's), with Hold, then committed.
        wait_requests(a, b)
        assert a.requests[0].mode == "Hold" and b.requests[0].mode == "Hold"
        for agent in (a, b):
            threading.Thread(target=agent.complete, args=(agent.requests[0],), daemon=True).start()
        body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Restoring", "Done", "Failed"), timeout=120)
        assert body["status"]["migration"]["restoreJob"] == "ring-restore-1"
        assert body["status"]["migration"]["checkpoint"] == "ring-drain-1"
        assert cluster_ns.get("checkpoints", "ring-drain-1") is not None
        assert cluster_ns.get(JOBS, "ring-drain-1")["status"]["phase"] == "Succeeded"  # type: ignore[index]
        wait_gone(cluster_ns, "ibckpt-ring")  # released: the drain's evictions may go on
        for reason in ("MigrationCommitted", "DrainReleased"):
            cluster_ns.wait_events("ring", reason)[0]
        # The restore recreates the pods under their names: it waits until the killed sources are gone
        # (no kubelet here finishes their deletion: the test does).
        assert "ring-0, ring-1 are gone" in cluster_ns.wait_events("ring", "WaitingForSources")[0].message
        assert cluster_ns.get("restorejobs", "ring-restore-1") is None
        # Once a kubelet reports a killed source's containers terminated, nothing of it runs: the schedule
        # removes it rather than wait for the node's cleanup. ring-1 reports nothing yet, so it waits.
        cluster_ns.report_killed("ring-0")
        assert "source pod ring-0 had ended" in cluster_ns.wait_events("ring", "SourceRemoved")[0].message
        wait_pod_gone(cluster_ns, "ring-0")
        assert cluster_ns.core.read_namespaced_pod("ring-1", cluster_ns.namespace).metadata.deletion_timestamp
        assert cluster_ns.get("restorejobs", "ring-restore-1") is None
        finish_deletion(cluster_ns, "ring-1")
        restore = cluster_ns.wait("restorejobs", "ring-restore-1", lambda o: True)
        assert restore is not None
        assert restore["spec"]["checkpointName"] == "ring-drain-1" and restore["spec"]["avoidNodes"] == [
            "node-a"
        ]
        assert restore["metadata"]["ownerReferences"][0]["uid"] == schedule["metadata"]["uid"]

        # The migration follows the RestoreJob to its end, whichever it is.
        restore = cluster_ns.wait(
            "restorejobs",
            "ring-restore-1",
            lambda o: (o.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
            timeout=180,
        )
        if restore["status"]["phase"] == "Succeeded":
            body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Done"))
            assert "moved off node-a" in cluster_ns.wait_events("ring", "Migrated")[0].message
            outcome = "Migrated"
        else:
            body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Failed"))
            assert body["status"]["drainReason"] == "RestoreFailed"
            assert "checkpoint ring-drain-1 is good" in body["status"]["drainMessage"]
            assert cluster_ns.wait_events("ring", "RestoreFailed")[0].type == "Warning"
            outcome = "Failed"
        text = handle.metrics()
    assert f'ibckpt_drain_migrations_total{{outcome="{outcome}",schedule="{ns}/ring"}} 1.0' in text


def test_with_the_webhook_down_the_pdb_holds_and_protection_ends_with_the_field(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IBCKPT_WEBHOOK", "off")
    agents.add(cluster_ns, "node-a", 1)
    cluster_ns.pod("ring-0", "node-a", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    with operator():
        cluster_ns.create(
            SCHEDULES, protect("ring", {"app": "ring"}, cluster_ns.s3_location(s3_server, bucket))
        )
        cluster_ns.wait(SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("protectedBy") is not None)
        status, message = evict(cluster_ns, "ring-0")
        assert status == 429 and "disruption budget" in message, message  # the apiserver's own answer
        assert (
            cluster_ns.core.read_namespaced_pod("ring-0", cluster_ns.namespace).metadata.deletion_timestamp
            is None
        )

        # Protection is the field: without it the PDB goes (and the schedule keeps its interval).
        cluster_ns.patch(SCHEDULES, "ring", {"spec": {"drain": None, "intervalSeconds": 3600}})
        body = cluster_ns.wait(
            SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("intervalSeconds") == 3600
        )
        wait_gone(cluster_ns, "ibckpt-ring")
        body = cluster_ns.wait(SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("drainPhase") is None)
        assert body["status"].get("protectedBy") is None
        cluster_ns.wait_events("ring", "ProtectionEnded")[0]
        status, message = evict(cluster_ns, "ring-0")
        assert status == 201, message


def test_a_failed_checkpoint_follows_each_policy_visibly(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    webhook_on: None,
) -> None:
    agent = agents.add(cluster_ns, "node-a", 1, "refuse")
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(agent, "web-0", {"app": "web"})
    cluster_ns.s3_secret(s3_server)
    where, ns = cluster_ns.s3_location(s3_server, bucket), cluster_ns.namespace
    with operator() as handle:
        cluster_ns.create(SCHEDULES, protect("hold", {"app": "ring"}, where, retrySeconds=10))
        cluster_ns.create(SCHEDULES, protect("lose", {"app": "web"}, where, onFailure="ProceedAndLose"))
        for name in ("hold", "lose"):
            cluster_ns.wait(SCHEDULES, name, lambda o: (o.get("status") or {}).get("protectedBy") is not None)
        webhook_configured(cluster_ns)
        cluster_ns.core.patch_node("node-a", {"spec": {"unschedulable": True}})

        # ProceedAndLose: the job's refusal lets the drain go on, and says the running state is lost.
        lost = cluster_ns.wait(SCHEDULES, "lose", drain_phase("Lost"), timeout=90)
        assert lost["status"]["drainReason"] == "PreflightRefused"
        assert "running state of lose is lost" in lost["status"]["drainMessage"]
        assert "unsupported verb ibv_alloc_dm" in lost["status"]["drainMessage"]
        assert cluster_ns.wait_events("lose", "DrainProceededStateLost")[0].type == "Warning"
        wait_gone(cluster_ns, "ibckpt-lose")
        status, message = evict(cluster_ns, "web-0")
        assert status == 201, message
        # The job started again from scratch (a new pod, elsewhere) is protected again.
        cluster_ns.node("node-b")
        cluster_ns.pod("web-1", "node-b", {"app": "web"})
        deadline = time.monotonic() + 60
        while cluster_ns.pdb("ibckpt-lose") is None:
            assert time.monotonic() < deadline, "the PDB never came back over the new pod"
            time.sleep(0.3)

        # KeepHolding: the drain stays held, loudly, and a new checkpoint is tried every retrySeconds.
        held = cluster_ns.wait(SCHEDULES, "hold", drain_phase("Held"), timeout=90)
        assert held["status"]["drainReason"] == "PreflightRefused"
        condition = {c["type"]: c for c in held["status"]["conditions"]}["DrainHeld"]
        assert condition["status"] == "True" and "still holding the drain of node-a" in condition["message"]
        assert cluster_ns.pdb("ibckpt-hold") is not None
        status, message = evict(cluster_ns, "ring-0")
        assert status == 429 and "ibckpt is HOLDING this drain" in message, message
        assert "drain.onFailure: ProceedAndLose" in message
        cluster_ns.wait(JOBS, "hold-drain-1-2", lambda o: True, timeout=60)
        text = handle.metrics()
    assert f'ibckpt_drain_held{{schedule="{ns}/hold"}} 1.0' in text
    assert f'ibckpt_drain_held{{schedule="{ns}/lose"}} 0.0' in text
    assert f'ibckpt_drain_migrations_total{{outcome="Lost",schedule="{ns}/lose"}} 1.0' in text


def test_an_eviction_alone_holds_and_only_an_uncordon_cancels(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    webhook_on: None,
) -> None:
    agent = agents.add(cluster_ns, "node-a", 1)  # "hang": the job stays Quiescing
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    with operator():
        cluster_ns.create(
            SCHEDULES, protect("ring", {"app": "ring"}, cluster_ns.s3_location(s3_server, bucket))
        )
        cluster_ns.wait(SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("protectedBy") is not None)
        webhook_configured(cluster_ns)
        # No cordon: the eviction itself starts the migration, and node-a staying schedulable does not
        # cancel it (it was never seen drained).
        status, message = evict(cluster_ns, "ring-0")
        assert status == 429 and "checkpointing ring before it leaves node-a (Holding" in message, message
        wait_requests(agent)  # the job touched the ranks: several passes went by
        job = cluster_ns.wait(
            JOBS, "ring-drain-1", lambda o: (o.get("status") or {}).get("phase") == "Quiescing"
        )
        assert job["spec"]["mode"] == "Stop"
        body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Checkpointing"))
        assert body["status"]["drainNodes"] == ["node-a"]
        # A cordon joins it; the uncordon of every drained node cancels it before the commit.
        cluster_ns.core.patch_node("node-a", {"spec": {"unschedulable": True}})
        cluster_ns.wait(SCHEDULES, "ring", lambda o: bool(o["status"].get("migration", {}).get("sources")))
        cluster_ns.core.patch_node("node-a", {"spec": {"unschedulable": None}})
        body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Idle"), timeout=60)
        assert body["status"]["drainReason"] == "DrainCancelled"
        assert body["status"]["migration"]["cancelledJob"] == "ring-drain-1"
        assert cluster_ns.wait_events("ring", "DrainCancelled")[0].type == "Normal"
        deadline = time.monotonic() + 60
        while cluster_ns.get(JOBS, "ring-drain-1") is not None:  # deleted: its abort resumes the ranks
            assert time.monotonic() < deadline, "the migration's job was never cancelled"
            time.sleep(0.3)
        assert [session for session, _ in agent.aborts] == [agent.requests[0].session_id]


def test_a_restarted_operator_carries_the_migration_on_and_a_retry_commits(
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IBCKPT_WEBHOOK", "off")
    agent = agents.add(cluster_ns, "node-a", 1, "hang", store_config(bucket))
    agents.add(cluster_ns, "node-b", 2)
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    schedule = protect("ring", {"app": "ring"}, cluster_ns.s3_location(s3_server, bucket), retrySeconds=10)
    with operator():
        cluster_ns.create(SCHEDULES, schedule)
        cluster_ns.wait(SCHEDULES, "ring", lambda o: (o.get("status") or {}).get("protectedBy") is not None)
        cluster_ns.core.patch_node("node-a", {"spec": {"unschedulable": True}})
        wait_requests(agent)
        before = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Checkpointing"))["status"]
    # The new operator reads the migration back from status. The job it was running aborts (its own
    # restart rule), so the hold goes on under KeepHolding and a retry commits.
    with operator():
        held = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Held"), timeout=60)["status"]
        assert (
            held["migration"]["seq"] == 1
            and held["migration"]["heldSince"] == before["migration"]["heldSince"]
        )
        assert held["drainReason"] == cluster_ns.get(JOBS, "ring-drain-1")["status"]["reason"]  # type: ignore[index]
        deadline = time.monotonic() + 60
        while len(agent.requests) < 2:
            jobs = cluster_ns.custom.list_namespaced_custom_object(GROUP, VERSION, cluster_ns.namespace, JOBS)
            seen = {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in jobs["items"]}
            assert time.monotonic() < deadline, f"no retry reached the agent: {len(agent.requests)}, {seen}"
            time.sleep(0.2)
        assert agent.requests[1].images.checkpoint_id == "ring-drain-1-2"
        threading.Thread(target=agent.complete, args=(agent.requests[1],), daemon=True).start()
        body = cluster_ns.wait(SCHEDULES, "ring", drain_phase("Restoring", "Done", "Failed"), timeout=120)
        assert body["status"]["migration"]["checkpoint"] == "ring-drain-1-2"
        finish_deletion(cluster_ns, "ring-0")
        restore = cluster_ns.wait("restorejobs", "ring-restore-1", lambda o: True)
        assert restore is not None and restore["spec"]["checkpointName"] == "ring-drain-1-2"
        assert cluster_ns.get(JOBS, "ring-drain-2") is None  # the same migration, not a new one
