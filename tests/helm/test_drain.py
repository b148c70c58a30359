"""One `kubectl drain node-1` moves three teams' RDMA jobs at once, on the real cluster with the chart
installed, each protected by a CheckpointSchedule's `drain` in its own namespace. In each team the job is
the same two-rank ring (rank 0 on node-1, rank 1 on node-2), owned differently:

- **team-bare: bare pods, the webhook down.** The namespace is labelled `ibckpt.io/admission=off`, so the
  apiserver never calls the operator's webhooks for it (as when the operator's node is unreachable:
  failurePolicy Ignore admits the eviction). The PodDisruptionBudget the operator keeps is what holds the
  drain (kubectl retries its "disruption budget" refusals). The pods share their nodes' network (as MPI
  jobs on RoCE often run), and ring-1 keeps one TCP connection to ring-0 open through the whole migration,
  as an MPI launcher keeps one to each worker's daemon: the RestoreJob maps node-1's address to node-2's in
  both images, the agent holds the connection until both are restored, and it carries a last exchange.
- **team-ring: batch Jobs** `ring-0` and `ring-1`, whose controller names each new pod anew (as an MPI
  launcher is a Job beside its workers). The commit deletes both pods and each Job at once wants a new one,
  which would run the ring from scratch: the webhook refuses them (by the Job's uid) until the restore is
  over. The RestoreJob creates the pods again under their names and labels on node-2, each Job adopts its
  pod and completes when the restored ring finishes.
- **team-sts: a StatefulSet** `ring`. Its controller creates the pods again under their names: the
  operator refuses them until their images are staged, then binds them to node-2 with the restore
  annotation (its mutating webhook), and the runtime wrapper restores them, same names and hostnames.

The drain is held while the operator checkpoints each job with Stop, and completes by itself. Every ring
then finishes on node-2 with every message delivered exactly once. The test only runs kubectl.
(These were three stories, each with a drain of its own, until 2026-12-01: merged for CI's time, and a
drain that meets several tenants' jobs at once is what a real cluster's maintenance does.)
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime
from typing import Any

import pytest
from helm.conftest import Release, team_namespace

from testbed import pods, ring
from testbed.cluster import Cluster, node_ip
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3000)]

SCHEDULE = "ring"
WEBHOOKS = "validatingwebhookconfiguration/ibckpt.io"
OFF = "ibckpt.io/admission"  # =off: the apiserver sends none of the namespace's requests to ibckpt
REFUSED = "ibckpt: the pods of this controller are being migrated by CheckpointSchedule ring"
Object = dict[str, Any]


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def said_about(said: str, namespace: str) -> str:
    """kubectl drain's lines about one namespace's pods."""
    return "\n".join(
        line for line in said.splitlines() if f'-n "{namespace}"' in line or f"{namespace}/" in line
    )


def test_one_drain_moves_bare_pods_jobs_and_a_statefulset_of_three_teams_each_exactly_once(
    installed: Release, job_ns: str, s3_server: S3Server
) -> None:
    cluster = installed.cluster
    with ExitStack() as teams:
        bare = teams.enter_context(team_namespace(installed, s3_server, "team-bare"))
        sts = teams.enter_context(team_namespace(installed, s3_server, "team-sts"))
        # Off long before the drain: the apiserver matches namespaceSelectors against its informer's copy
        # of the namespace, which a loaded control plane updates late.
        cluster.kubectl("label", "namespace", bare, f"{OFF}=off")
        with ThreadPoolExecutor(3) as pool:  # a pod's start costs half a minute or more on these nodes
            bare_started = pool.submit(ring.start, cluster, bare, host_network=True)
            jobs_started = pool.submit(ring.start_jobs, cluster, job_ns)
            sts_started = pool.submit(ring.start_statefulset, cluster, sts)
            names = jobs_started.result()
            bare_started.result()
            sts_started.result()
        before = Before(cluster, bare, job_ns, sts, names)
        try:
            began = time.time()
            said = ring.drain_node_1(cluster, job_ns, "--force")
            drained = time.time()
            done = {
                ns: ring.wait_phase(cluster, ns, "checkpointschedule", SCHEDULE, "Done", 900, "drainPhase")
                for ns in (bare, job_ns, sts)
            }
            settled = time.time()
        finally:
            cluster.kubectl("uncordon", "node-1", check=False)
            cluster.kubectl("label", "namespace", bare, f"{OFF}-", check=False)
        print(f"one drain of three jobs to running elsewhere: {settled - began:.1f}s (kubectl drain done at "
              f"{drained - began:.1f}s)\nkubectl drain said:\n{said[-3000:]}")  # fmt: skip
        bare_pods_moved(cluster, bare, said_about(said, bare), done[bare], began)
        jobs_moved(cluster, job_ns, said_about(said, job_ns), done[job_ns], before)
        statefulset_moved(cluster, sts, said_about(said, sts), done[sts], before)


class Before:
    """What each team's job was before the drain, once every schedule protects it."""

    def __init__(self, cluster: Cluster, bare: str, jobs_ns: str, sts: str, names: dict[str, str]) -> None:
        deadline = time.monotonic() + 60  # the keeper connects beside rc_seq: its line may come after READY
        while True:
            opened = cluster.kubectl("logs", "-n", bare, "ring-1").stdout
            if "keeper-connected before" in opened or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert "keeper-connected before" in opened, opened  # node-2 to node-1's address, before the drain
        protected = ring.protect(cluster, bare, ring.job_template(), name=SCHEDULE)
        pdb = pods.get(cluster, bare, "pdb", f"ibckpt-{SCHEDULE}")
        assert pdb["spec"]["maxUnavailable"] == 0 and pdb["spec"]["selector"] == {"matchLabels": ring.LABELS}
        assert protected["status"].get("drainPhase") in (None, "Idle"), protected["status"]
        webhooks = json.loads(cluster.kubectl("get", WEBHOOKS, "-o", "json").stdout)["webhooks"]
        assert webhooks[0]["failurePolicy"] == "Ignore", webhooks

        self.names = names
        self.jobs = {name: pods.get(cluster, jobs_ns, "job", name) for name in ring.MEMBERS}
        self.job_sources = {job: pods.get(cluster, jobs_ns, "pod", pod) for job, pod in names.items()}
        placed = {job: p["spec"]["nodeName"] for job, p in self.job_sources.items()}
        assert placed == {"ring-0": "node-1", "ring-1": "node-2"}, placed
        ring.protect(cluster, jobs_ns, ring.job_template(), name=SCHEDULE)

        self.sts_placement = ring.placement(cluster, sts)
        spread = sorted(self.sts_placement.values())
        assert spread == ["node-1", "node-2"], f"the scheduler did not spread the ring: {self.sts_placement}"
        self.sts_uids = {
            name: pods.get(cluster, sts, "pod", name)["metadata"]["uid"] for name in ring.MEMBERS
        }
        template = {
            **ring.job_template(),
            "workloadRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "ring"},
        }
        del template["selector"]
        ring.protect(cluster, sts, template, name=SCHEDULE)
        pdb = pods.get(cluster, sts, "pdb", f"ibckpt-{SCHEDULE}")
        assert pdb["spec"]["selector"] == {"matchLabels": ring.LABELS}, pdb["spec"]  # the StatefulSet's own


def bare_pods_moved(cluster: Cluster, namespace: str, said: str, done: Object, began: float) -> None:
    # held by the PDB alone: the eviction of ring-0 was refused (and retried) while the job was
    # checkpointed, with the apiserver's disruption-budget message, not the webhook's
    assert "ring-0" in said and "will retry" in said, said[-4000:]
    assert "disruption budget" in said and "ibckpt:" not in said, said[-4000:]
    migration = done["status"]["migration"]
    assert done["status"]["drainNodes"] == ["node-1"], done["status"]
    assert {s["name"] for s in migration["sources"]} == set(ring.MEMBERS), migration
    job, checkpoint, restore = ring.migrated(cluster, namespace, done)
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
        events = pods.get(cluster, namespace, "events")["items"]
        reasons = {e["reason"] for e in events if e["involvedObject"].get("name") == SCHEDULE}
        found = cluster.kubectl(
            "get", "pdb", f"ibckpt-{SCHEDULE}", "-n", namespace, "-o", "json", check=False
        )
        protected_again = found.returncode == 0 and json.loads(found.stdout)["spec"]["maxUnavailable"] == 0
    assert wanted <= reasons, reasons
    assert protected_again, "no PDB protects the restored pods"

    assert ring.placement(cluster, namespace) == {"ring-0": "node-2", "ring-1": "node-2"}
    ring.finish(cluster, namespace)
    # the connection opened to node-1's address before the drain carried the last exchange on node-2 (the
    # restored container's log starts at the restore)
    kept = cluster.kubectl("logs", "-n", namespace, "ring-1").stdout
    assert "tcp-kept after" in kept, kept[-3000:]
    assert "keeper-served" in cluster.kubectl("logs", "-n", namespace, "ring-0").stdout
    hold = stamp(job["metadata"]["creationTimestamp"]) - began
    print(
        f"bare pods: hold {hold:.1f}s (cordon to CheckpointJob) + checkpoint {ring.seconds(job):.1f}s "
        f"(Stop job: dump, upload, commit, kill) + restore {ring.seconds(restore):.1f}s (RestoreJob, created "
        f"at {stamp(restore['metadata']['creationTimestamp']) - began:.1f}s)"
    )


def jobs_moved(cluster: Cluster, namespace: str, said: str, done: Object, before: Before) -> None:
    assert f"checkpointing {SCHEDULE} before it leaves node-1" in said, said[-4000:]
    names, jobs, sources = before.names, before.jobs, before.job_sources
    migration = done["status"]["migration"]
    recorded = {s["name"]: s.get("controllerUid") for s in migration["sources"]}
    assert recorded == {names[job]: jobs[job]["metadata"]["uid"] for job in ring.MEMBERS}, migration
    checkpoint = pods.get(cluster, namespace, "checkpoint", migration["checkpoint"])
    assert {p["template"]["controller"]["kind"] for p in checkpoint["spec"]["pods"]} == {"Job"}
    restore = pods.get(cluster, namespace, "restorejob", migration["restoreJob"])
    assert restore["status"]["phase"] == "Succeeded" and restore["spec"]["avoidNodes"] == ["node-1"]
    assert restore["spec"].get("podsCreatedBy", "RestoreJob") == "RestoreJob", restore["spec"]

    # Each Job has exactly its source's name back (no pod of its own), on node-2, restored and adopted.
    restored_from = f"{namespace}/{migration['checkpoint']}"
    for job, found in ring.job_pods(cluster, namespace).items():
        assert list(found) == [names[job]], f"Job {job} has pods {sorted(found)}, not only {names[job]}"
        pod = found[names[job]]
        meta = pod["metadata"]
        assert meta["uid"] != sources[job]["metadata"]["uid"] and pod["spec"]["nodeName"] == "node-2"
        assert meta["annotations"]["ibckpt.io/restore-from"] == restored_from, meta["annotations"]
        owners = [(o["kind"], o["uid"], o.get("controller")) for o in meta.get("ownerReferences") or ()]
        assert owners == [("Job", jobs[job]["metadata"]["uid"], True)], f"{job}: {owners}"
    refused = [
        e for e in pods.get(cluster, namespace, "events")["items"]
        if e["involvedObject"].get("kind") == "Job" and REFUSED in e.get("message", "")
    ]  # fmt: skip
    assert refused, "no Job's new pod was refused during the migration"

    time.sleep(5)
    for job in ring.MEMBERS:
        cluster.kubectl("exec", "-n", namespace, names[job], "--", "touch", "/tmp/stop")
    for job in ring.MEMBERS:
        pods.wait_pod(cluster, namespace, names[job], {"Succeeded"}, timeout=300)
    log = "".join(cluster.kubectl("logs", "-n", namespace, names[job]).stdout for job in ring.MEMBERS)
    assert log.count("ring-done") == 2, log[-3000:]
    ring.assert_exactly_once(log)
    deadline = time.monotonic() + 120
    while True:  # each Job counts its adopted pod's success as its own and completes
        states = {job: pods.get(cluster, namespace, "job", job)["status"] for job in ring.MEMBERS}
        complete = {
            job: any(c["type"] == "Complete" and c["status"] == "True" for c in s.get("conditions") or ())
            for job, s in states.items()
        }
        if all(complete.values()) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert all(complete.values()) and all(s.get("succeeded") == 1 for s in states.values()), states
    assert all(len(found) == 1 for found in ring.job_pods(cluster, namespace).values())
    print(f"Jobs: new pods of the Jobs refused meanwhile: {sum(e.get('count', 1) for e in refused)}")


def statefulset_moved(cluster: Cluster, namespace: str, said: str, done: Object, before: Before) -> None:
    assert "will retry" in said and f"checkpointing {SCHEDULE} before it leaves node-1" in said, said[-4000:]
    job, checkpoint, restore = ring.migrated(cluster, namespace, done)
    assert {p["name"]: p["node"] for p in checkpoint["spec"]["pods"]} == before.sts_placement
    assert {p["template"]["controller"]["kind"] for p in checkpoint["spec"]["pods"]} == {"StatefulSet"}
    assert restore["spec"]["podsCreatedBy"] == "Controller", restore["spec"]

    # the StatefulSet's own new pods (new uids, same names and hostnames), bound to node-2 and restored
    assert ring.placement(cluster, namespace) == {"ring-0": "node-2", "ring-1": "node-2"}
    restored_from = f"{namespace}/{checkpoint['metadata']['name']}"
    for name in ring.MEMBERS:
        pod = pods.get(cluster, namespace, "pod", name)
        meta = pod["metadata"]
        assert meta["uid"] != before.sts_uids[name], f"{name} was not replaced"
        assert [o["kind"] for o in meta["ownerReferences"]] == ["StatefulSet"], meta["ownerReferences"]
        assert meta["annotations"]["ibckpt.io/restore-from"] == restored_from, meta["annotations"]
        hostname = cluster.kubectl("exec", "-n", namespace, name, "--", "hostname").stdout.strip()
        assert hostname == name
    refused = [
        e for e in pods.get(cluster, namespace, "events")["items"]
        if e["involvedObject"].get("kind") == "StatefulSet" and "ibckpt: pod ring-" in e.get("message", "")
    ]  # fmt: skip
    ring.finish_statefulset(cluster, namespace)
    print(
        f"StatefulSet: CheckpointJob {ring.seconds(job):.1f}s, RestoreJob {ring.seconds(restore):.1f}s; "
        f"creations refused while the images staged: {sum(e.get('count', 1) for e in refused)}"
    )
