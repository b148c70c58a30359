"""Node drain with the operator's eviction webhook down, on the real cluster with the chart installed: a
two-pod RDMA job of bare pods (ring-0 on node-1, ring-1 on node-2) protected by a CheckpointSchedule's
`drain`. The job's namespace is labelled `ibckpt.io/admission=off`, so the apiserver never calls the
eviction webhook (as when the operator's node is unreachable: failurePolicy Ignore admits the eviction;
a label the leader never rewrites, where a patched URL is undone by a restarting leader), and the
PodDisruptionBudget the operator keeps is what holds
`kubectl drain node-1` (its "disruption budget" refusals, retried by kubectl). The operator still sees the
cordon, checkpoints the whole job with Stop, commits, relaxes the PDB, and the drain completes by itself;
the RestoreJob brings the job back on node-2, where it finishes with every message delivered exactly once.
The test only runs kubectl. (tests/helm/test_drain_statefulset.py drains with the webhook up.)

The two pods share their nodes' network (hostNetwork, as MPI jobs on RoCE often run) and ring-1 keeps one
TCP connection to ring-0 open through the whole migration, as an MPI launcher keeps one to each worker's
daemon: the RestoreJob maps node-1's address to node-2's in both pods' images, the agent holds the
connection until both are restored, and the same connection carries a last exchange at the end.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from helm.conftest import Release

from testbed import pods, ring
from testbed.cluster import node_ip

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=10)]

SCHEDULE = "ring"
WEBHOOKS = "validatingwebhookconfiguration/ibckpt.io"
OFF = "ibckpt.io/admission"  # =off: the apiserver sends none of the namespace's requests to ibckpt


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def test_with_the_webhook_down_the_pdb_holds_kubectl_drain_and_the_job_runs_on_the_other_node_exactly_once(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    ring.start(cluster, job_ns, host_network=True)
    # Off long before the drain: the apiserver matches namespaceSelectors against its informer's copy of
    # the namespace, which a loaded control plane updates late; a label set just before the drain let
    # the webhook answer the first evictions.
    cluster.kubectl("label", "namespace", job_ns, f"{OFF}=off")
    deadline = time.monotonic() + 60  # the keeper connects beside rc_seq: its line may come after READY
    while True:
        opened = cluster.kubectl("logs", "-n", job_ns, "ring-1").stdout
        if "keeper-connected before" in opened or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "keeper-connected before" in opened, opened  # node-2 to node-1's address, before the drain
    protected = ring.protect(cluster, job_ns, ring.job_template(), name=SCHEDULE)
    pdb = pods.get(cluster, job_ns, "pdb", f"ibckpt-{SCHEDULE}")
    assert pdb["spec"]["maxUnavailable"] == 0 and pdb["spec"]["selector"] == {"matchLabels": ring.LABELS}
    assert protected["status"].get("drainPhase") in (None, "Idle"), protected["status"]

    webhooks = json.loads(cluster.kubectl("get", WEBHOOKS, "-o", "json").stdout)["webhooks"]
    assert webhooks[0]["failurePolicy"] == "Ignore", webhooks
    try:
        began = time.time()
        said = ring.drain_node_1(cluster, job_ns, "--force")
        drained = time.time()
        # held by the PDB alone: the eviction of ring-0 was refused (and retried) while the job was
        # checkpointed, with the apiserver's disruption-budget message, not the webhook's
        assert "ring-0" in said and "will retry" in said, said[-4000:]
        assert "disruption budget" in said and "ibckpt:" not in said, said[-4000:]
        done = ring.wait_phase(cluster, job_ns, "checkpointschedule", SCHEDULE, "Done", 900, "drainPhase")
        settled = time.time()
    finally:
        cluster.kubectl("uncordon", "node-1", check=False)
        cluster.kubectl("label", "namespace", job_ns, f"{OFF}-", check=False)

    migration = done["status"]["migration"]
    assert done["status"]["drainNodes"] == ["node-1"], done["status"]
    assert {s["name"] for s in migration["sources"]} == set(ring.MEMBERS), migration
    job, checkpoint, restore = ring.migrated(cluster, job_ns, done)
    recorded = {p["name"]: p["node"] for p in checkpoint["spec"]["pods"]}
    assert recorded == {"ring-0": "node-1", "ring-1": "node-2"}, recorded
    addresses = {p["name"]: p["hostIP"] for p in checkpoint["spec"]["pods"]}
    assert addresses == {"ring-0": node_ip(1), "ring-1": node_ip(2)}, addresses
    # Done is written before its actions run (status first): the Event and the new PDB follow it
    wanted = {"DrainHeld", "MigrationCommitted", "DrainReleased", "Migrated"}
    deadline, protected_again = time.monotonic() + 120, False
    reasons: set[str] = set()
    while time.monotonic() < deadline and not (wanted <= reasons and protected_again):
        time.sleep(3)
        events = pods.get(cluster, job_ns, "events")["items"]
        reasons = {e["reason"] for e in events if e["involvedObject"].get("name") == SCHEDULE}
        found = cluster.kubectl("get", "pdb", f"ibckpt-{SCHEDULE}", "-n", job_ns, "-o", "json", check=False)
        protected_again = found.returncode == 0 and json.loads(found.stdout)["spec"]["maxUnavailable"] == 0
    assert wanted <= reasons, reasons
    assert protected_again, "no PDB protects the restored pods"

    assert ring.placement(cluster, job_ns) == {"ring-0": "node-2", "ring-1": "node-2"}
    ring.finish(cluster, job_ns)
    # the connection opened to node-1's address before the drain carried the last exchange on node-2 (the
    # restored container's log starts at the restore)
    kept = cluster.kubectl("logs", "-n", job_ns, "ring-1").stdout
    assert "tcp-kept after" in kept, kept[-3000:]
    assert "keeper-served" in cluster.kubectl("logs", "-n", job_ns, "ring-0").stdout

    hold = stamp(job["metadata"]["creationTimestamp"]) - began
    print(
        "drain to running elsewhere: "
        f"{settled - began:.1f}s = hold {hold:.1f}s (cordon to CheckpointJob) "
        f"+ checkpoint {ring.seconds(job):.1f}s (Stop job: dump, upload, commit, kill) "
        f"+ drain done at {drained - began:.1f}s "
        f"+ restore {ring.seconds(restore):.1f}s (RestoreJob, created at "
        f"{stamp(restore['metadata']['creationTimestamp']) - began:.1f}s)"
    )
    jobs = ring.seconds(job) + ring.seconds(restore)
    print(f"drain to running elsewhere / (its CheckpointJob + RestoreJob): {(settled - began) / jobs:.2f}")
    print(f"kubectl drain said:\n{said[-2500:]}")
    print(f"drain job: {json.dumps(job['status'].get('pods'))[:1500]}")
    print(f"drain restore: {json.dumps(restore['status'].get('pods'))[:1500]}")
