"""The operator process against the real apiserver and the real S3: bad input touches nothing and says why,
admission, two jobs over the same pods, a restart mid-phase, a whole LeaveRunning checkpoint committed to
S3, the Checkpoint finalizer, the Lease, and /metrics. Node agents are fakes speaking ibckpt.agentapi."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
import pytest

from ibckpt.agentapi import Milestone, RankPhase
from ibckpt.store import ImageStore
from testbed.gate import Gate
from testbed.ports import free_port
from testbed.s3 import S3Server
from testbed.status import phase

OPERATOR_NS = "ibckpt-system"  # as conftest.py sets it up
Agents = Cluster = Any  # conftest.py's fixtures (a test module cannot import its conftest by name)

pytestmark = [pytest.mark.kube, pytest.mark.s3]
JOBS = "checkpointjobs"


def storage(
    s3: S3Server, bucket: str, secret: str = "s3-creds", endpoint: str | None = None
) -> dict[str, Any]:
    return {
        "endpoint": endpoint or s3.endpoint,
        "region": s3.region,
        "bucket": bucket,
        "credentialsSecretRef": {"name": secret},
    }


def job(
    name: str, location: dict[str, Any], labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"storage": location, **spec}
    if "workloadRef" not in spec:
        body["selector"] = {"matchLabels": labels or {"app": "ring"}}
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": body,
    }


def creds(cluster: Cluster, s3: S3Server, name: str = "s3-creds", secret_key: str | None = None) -> None:
    cluster.secret(
        name, {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": secret_key or s3.secret_key}
    )


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == kind)


def assert_failed(cluster: Cluster, body: dict[str, Any], reason: str, *words: str) -> None:
    status = body["status"]
    assert status["phase"] == "Failed" and status["reason"] == reason, status
    failed = condition(body, "Failed")
    assert failed["status"] == "True" and failed["reason"] == reason
    assert failed["observedGeneration"] == body["metadata"]["generation"]
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "Progressing")["status"] == "False"
    for word in words:
        assert word in status["message"], status["message"]
    deadline = time.monotonic() + 10
    while True:  # Events are posted right after the status that names the failure
        warnings = [
            e for e in cluster.events(body["metadata"]["name"]) if e.type == "Warning" and e.reason == reason
        ]
        if warnings:
            break
        assert time.monotonic() < deadline, f"no Warning Event {reason}"
        time.sleep(0.2)
    for word in words:
        assert word in warnings[0].message


def ring_on_two_agents(cluster: Cluster, s3: S3Server, agents: Agents, config: Any) -> tuple[Any, Any]:
    """ring-0 on node-a, ring-1 on node-b, each node's fake agent completing sessions in the real S3 of
    `config`, and the job's credentials: (node-a's agent, node-b's)."""
    a = agents.add(cluster, "node-a", 1, "complete", config)
    b = agents.add(cluster, "node-b", 2, "complete", config)
    cluster.rank_pod(a, "ring-0", {"app": "ring"})
    cluster.rank_pod(b, "ring-1", {"app": "ring"})
    creds(cluster, s3)
    return a, b


def test_a_status_that_cannot_be_read_back_fails_the_job_once(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """A status with an attempt that no driver wrote (no start time): the operator fails the job with
    InvalidStatus instead of retrying its daemon forever, and touches no pod."""
    agent = agents.add(cluster_ns, "node-a", 1)
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    creds(cluster_ns, s3_server)
    cluster_ns.create(JOBS, job("foreign", storage(s3_server, bucket)))
    cluster_ns.patch_status(JOBS, "foreign", {"phase": "Quiescing", "attempt": "abc-3", "step": "quiesce"})
    with operator():
        body = cluster_ns.wait(JOBS, "foreign", phase("Failed"))
    assert_failed(cluster_ns, body, "InvalidStatus", "cannot be read back", "start time")
    assert agent.requests == [] and agent.aborts == []


def test_selector_matching_nothing_fails_and_touches_nothing(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    agent = agents.add(cluster_ns, "node-a", 1)
    other = cluster_ns.pod("web-0", "node-a", {"app": "web"})
    agent.register(other, cluster_ns.namespace)
    before = cluster_ns.core.read_namespaced_pod("web-0", cluster_ns.namespace).metadata.resource_version
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job("nothing", storage(s3_server, bucket)))
        body = cluster_ns.wait(JOBS, "nothing", phase("Failed"))
    assert_failed(cluster_ns, body, "NoPods", "no pod matches")
    assert body["status"].get("podCount") == 0
    after = cluster_ns.core.read_namespaced_pod("web-0", cluster_ns.namespace).metadata.resource_version
    assert after == before and agent.requests == []


def test_a_checkpoint_name_already_taken_fails_before_any_pod_is_touched(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """A commit never replaces a checkpoint (the store refuses it too: tests/store/test_parts.py); the
    job says so in Pending, before its pods are even selected."""
    agent = agents.add(cluster_ns, "node-a", 1)
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    creds(cluster_ns, s3_server)
    taken = {"apiVersion": "ibckpt.io/v1alpha1", "kind": "Checkpoint",
             "metadata": {"name": "taken", "annotations": {"ibckpt.io/retain-images": "true"}},
             "spec": {"manifestKey": "ibckpt/v1/manifests/x/ring/taken.json",
                      "storageRef": {"name": "s"}}}  # fmt: skip
    cluster_ns.create("checkpoints", taken)
    with operator():
        cluster_ns.create(JOBS, job("again", storage(s3_server, bucket), checkpointName="taken"))
        body = cluster_ns.wait(JOBS, "again", phase("Failed"))
    assert_failed(
        cluster_ns, body, "CheckpointExists", f"Checkpoint {cluster_ns.namespace}/taken already exists"
    )
    assert agent.requests == [] and not body["status"].get("pods")
    assert cluster_ns.get("checkpoints", "taken")["spec"] == taken["spec"]


def test_missing_credentials_secret(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    agents.add(cluster_ns, "node-a", 1)
    cluster_ns.pod("ring-0", "node-a", {"app": "ring"})
    # and a client-side encryption key's Secret that is not there: refused before any rank is touched
    sealed = {**storage(s3_server, bucket), "encryption": {"mode": "client", "keySecretRef": {"name": "k"}}}
    creds(cluster_ns, s3_server)  # the sealed storage's credentials are there; its key's Secret is not
    with operator():
        cluster_ns.create(JOBS, job("nosecret", storage(s3_server, bucket, secret="absent")))
        cluster_ns.create(JOBS, job("sealed", sealed))
        body = cluster_ns.wait(JOBS, "nosecret", phase("Failed"))
        refused = cluster_ns.wait(JOBS, "sealed", phase("Failed"))
    assert_failed(cluster_ns, body, "SecretNotFound", f"{cluster_ns.namespace}/absent", "does not exist")
    assert not body["status"].get("pods")  # failed before any pod was even selected
    assert_failed(cluster_ns, refused, "SecretNotFound", f"encryption key Secret {cluster_ns.namespace}/k")
    assert not refused["status"].get("pods")


def test_wrong_credentials_and_unreachable_endpoint(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    agents.add(cluster_ns, "node-a", 1)
    cluster_ns.pod("ring-0", "node-a", {"app": "ring"})
    creds(cluster_ns, s3_server, "wrong", secret_key="not-the-secret-key")
    dead = f"http://127.0.0.1:{free_port()}"
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job("badkey", storage(s3_server, bucket, secret="wrong")))
        cluster_ns.create(JOBS, job("nowhere", storage(s3_server, bucket, endpoint=dead)))
        wrong = cluster_ns.wait(JOBS, "badkey", phase("Failed"))
        unreachable = cluster_ns.wait(JOBS, "nowhere", phase("Failed"))
    assert_failed(cluster_ns, wrong, "StorageCredentialsRejected", "rejected the credentials", bucket)
    assert_failed(cluster_ns, unreachable, "StorageUnreachable", "cannot reach the S3 endpoint", dead)
    for body in (wrong, unreachable):  # the secret key is nowhere in what the operator wrote
        assert "not-the-secret-key" not in str(body) and s3_server.secret_key not in str(body)
        for event in cluster_ns.events(body["metadata"]["name"]):
            assert "not-the-secret-key" not in event.message and s3_server.secret_key not in event.message


def test_pod_on_a_node_without_a_ready_agent(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """An agent pod not Ready yet is waited for: node-c's becomes Ready and job `late` goes on. One that
    stays not Ready for the whole wait refuses its pods: job `noagent` fails before anything is touched.
    The agent of a node that is itself not Ready is not waited for (job `dead`)."""
    agent = agents.add(cluster_ns, "node-a", 1)
    late = agents.add(cluster_ns, "node-c", 3, ready=False)
    agents.add(cluster_ns, "node-d", 4, ready=False)
    gone = agents.add(cluster_ns, "node-e", 5, ready=False)
    cluster_ns.node("node-e", ready=False)
    late.register(cluster_ns.pod("late-0", "node-c", {"app": "late"}), cluster_ns.namespace)
    gone.register(cluster_ns.pod("dead-0", "node-e", {"app": "dead"}), cluster_ns.namespace)
    for name, node in (("ring-0", "node-a"), ("ring-1", "node-d")):
        agent.register(cluster_ns.pod(name, node, {"app": "ring"}), cluster_ns.namespace)
    creds(cluster_ns, s3_server)
    with operator(agent_ready_wait_seconds=15.0):
        cluster_ns.create(JOBS, job("late", storage(s3_server, bucket), labels={"app": "late"}))
        cluster_ns.create(JOBS, job("noagent", storage(s3_server, bucket)))
        cluster_ns.create(JOBS, job("dead", storage(s3_server, bucket), labels={"app": "dead"}))
        dead = cluster_ns.wait(JOBS, "dead", phase("Failed"))
        assert "agent-node-e is not Ready" in dead["status"]["message"], dead["status"]
        assert not [e for e in cluster_ns.events("dead") if e.reason == "WaitingForAgent"]
        waiting = cluster_ns.wait_events("late", "WaitingForAgent")[0]
        assert "agent agent-node-c to be Ready" in waiting.message, waiting.message
        cluster_ns.wait_events("noagent", "WaitingForAgent")
        cluster_ns.agent_pod_ready("node-c")
        body = cluster_ns.wait(JOBS, "noagent", phase("Failed"))
        going = cluster_ns.get(JOBS, "late")
    assert going is not None and going["status"]["phase"] != "Failed", going["status"]
    assert going["status"]["pods"][0]["phase"] not in ("Selected", "Refused"), going["status"]["pods"]
    assert_failed(
        cluster_ns,
        body,
        "AdmissionRefused",
        "pod ring-1 is on node node-d which has no ready ibckpt agent (agent-node-d is not Ready)",
    )
    rows = {row["name"]: row for row in body["status"]["pods"]}
    assert rows["ring-1"]["phase"] == "Refused" and rows["ring-1"]["node"] == "node-d"
    assert rows["ring-0"]["uid"] and agent.requests == []  # admission comes before any touch
    assert body["status"]["claimed"] is False


def test_workload_ref_walks_owners(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """Pods owned by a Job (any kind works) are the members; a pod of another owner is not."""
    agents.add(cluster_ns, "node-a", 1)
    batch = kubernetes.client.BatchV1Api(cluster_ns.api)
    template = {"spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "ring:test"}]}}
    owner = batch.create_namespaced_job(
        cluster_ns.namespace,
        {"metadata": {"name": "solver"}, "spec": {"template": template, "suspend": True}},
    )
    ref = [{"apiVersion": "batch/v1", "kind": "Job", "name": "solver", "uid": owner.metadata.uid}]
    cluster_ns.pod("solver-0", "node-a", {"x": "1"}, owners=ref)
    cluster_ns.pod("solver-1", "node-a", {"x": "2"}, owners=ref)
    cluster_ns.pod("bystander", "node-a", {"x": "3"})
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(
            JOBS, job("bywork", storage(s3_server, bucket), workloadRef={"kind": "Job", "name": "solver"})
        )
        body = cluster_ns.wait(JOBS, "bywork", phase("Failed"))
    # Nothing registered with the agent: admission refuses, naming a member.
    assert body["status"]["reason"] == "AdmissionRefused"
    assert sorted(row["name"] for row in body["status"]["pods"]) == ["solver-0", "solver-1"]
    assert "no container registered" in body["status"]["message"]


def test_two_jobs_over_the_same_pods(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    a = agents.add(cluster_ns, "node-a", 1)
    b = agents.add(cluster_ns, "node-b", 2)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(b, "ring-1", {"app": "ring"})
    creds(cluster_ns, s3_server)
    ns = cluster_ns.namespace
    with operator():
        cluster_ns.create(JOBS, job("first", storage(s3_server, bucket)))
        first = cluster_ns.wait(JOBS, "first", phase("Quiescing"))
        request = a.first_request()
        b.first_request()
        assert first["status"]["claimed"] is True and len(a.requests) == len(b.requests) == 1
        assert request.coordinator.startswith("127.0.0.1:") and request.ranks[0].container == "main"
        assert request.session_id == f"ckj-{first['status']['attempt'].rpartition('-')[0]}"
        cluster_ns.create(JOBS, job("second", storage(s3_server, bucket), concurrencyPolicy="Fail"))
        second = cluster_ns.wait(JOBS, "second", phase("Failed"))
        assert_failed(cluster_ns, second, "PodsBusy", f"being checkpointed by {ns}/first")
        cluster_ns.create(JOBS, job("third", storage(s3_server, bucket)))
        third = cluster_ns.wait(
            JOBS, "third", lambda o: (o.get("status") or {}).get("reason") == "WaitingForPods"
        )
        assert third["status"]["phase"] == "Pending" and third["status"]["waitingFor"] == f"{ns}/first"
        # Deleting the first job cancels it: every rank is brought back, then the third gets the pods.
        cluster_ns.delete(JOBS, "first")
        cluster_ns.wait(JOBS, "third", phase("Quiescing"), timeout=60)
        deadline = time.monotonic() + 30
        while cluster_ns.get(JOBS, "first") is not None:  # its finalizer goes once its daemon ended
            assert time.monotonic() < deadline, "the cancelled job was never released"
            time.sleep(0.3)
    assert [session for session, _ in a.aborts][:1] == [request.session_id]
    assert "deleted" in a.aborts[0][1]


def test_a_checkpoint_waits_its_turn_on_a_node_whose_agent_runs_another_session(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """node-b's agent is busy with another job's session: node-a's session is taken back, the job waits in
    Pending (Event WaitingForAgent) and, once node-b is free, checkpoints with a new session id."""
    config = store_config(bucket)
    a, b = ring_on_two_agents(cluster_ns, s3_server, agents, config)
    b.busy_with = "rsj-other-job"
    with operator():
        cluster_ns.create(JOBS, job("turn", storage(s3_server, bucket)))
        [waiting] = cluster_ns.wait_events("turn", "WaitingForAgent")
        busy = "node-b is busy with session 'rsj-other-job'"
        assert waiting.type == "Normal" and waiting.message.startswith("node node-b: "), waiting.message
        assert busy in waiting.message and "asks again in 10s" in waiting.message, waiting.message
        held = cluster_ns.wait(JOBS, "turn", lambda o: (o.get("status") or {}).get("sessionTurn") == 1)
        assert held["status"]["phase"] in ("Pending", "Admitted", "Quiescing"), held["status"]
        first = a.first_request().session_id
        assert [session for session, _ in a.aborts] == [first] and not b.requests
        b.busy_with = None  # the other job's session ended
        done = cluster_ns.wait(JOBS, "turn", phase("Succeeded"), timeout=90)
    assert [r.session_id for r in a.requests] == [first, f"{first}-1"]
    assert [r.session_id for r in b.requests] == [f"{first}-1"]
    assert done["status"]["sessionTurn"] == 1 and done["status"]["claimed"] is False


@pytest.mark.parametrize(
    ("cut_phase", "step", "passed"),
    [("Quiescing", "quiesce", None), ("Draining", "drain", Milestone.QUIESCED),
     ("Releasing", "release", Milestone.DRAINED), ("Dumping", "dump", Milestone.RELEASED),
     ("Uploading", "upload", Milestone.DUMPED)],
)  # fmt: skip
def test_operator_restart_mid_phase_aborts_from_status(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, cut_phase: str,
    step: str, passed: Milestone | None,
) -> None:  # fmt: skip
    """The operator stops while the agent reports its ranks in each phase of the cut, the dump or the upload
    (as when its pod is deleted): the next one aborts the job from its status, as a new attempt."""
    a = agents.add(cluster_ns, "node-a", 1)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job("restarted", storage(s3_server, bucket)))
        before = cluster_ns.wait(JOBS, "restarted", phase("Quiescing"))
        session = a.first_request().session_id
        if cut_phase != "Quiescing":  # the agent's ranks move on; the job's phase follows their reports
            a.set_phase(session, RankPhase(cut_phase), passed)  # the operator reads `done`
            before = cluster_ns.wait(JOBS, "restarted", phase(cut_phase))
    # The operator is gone while the ranks were in that phase: the outcome of its step is unknown.
    status = before["status"]
    assert status["step"] == step and status["attempt"]
    run, _, seq = status["attempt"].rpartition("-")
    with operator():
        after = cluster_ns.wait(JOBS, "restarted", phase("Failed"))
    assert_failed(cluster_ns, after, "OperatorRestarted", step, "outcome is unknown")
    assert after["status"]["abortedFrom"] == cut_phase
    new_run, _, new_seq = after["status"]["attempt"].rpartition("-")
    assert new_run == run and int(new_seq) > int(seq)  # the same run, a new attempt: never a blind replay
    assert [s for s, _ in a.aborts] == [f"ckj-{run}"] and len(a.requests) == 1
    # the first coordinator went with the first operator: the abort names the one opened to replace it
    assert len(a.rejoins) == 1 and re.fullmatch(r"[^:\s]+:[0-9]+", a.rejoins[0] or ""), a.rejoins


def _left_releasing(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agent: Any, operator: Any, name: str
) -> str:
    """Job `name` on one rank of `agent`, its operator gone while the ranks were releasing; its session."""
    cluster_ns.rank_pod(agent, "ring-0", {"app": "ring"})
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job(name, storage(s3_server, bucket)))
        cluster_ns.wait(JOBS, name, phase("Quiescing"))
        session: str = agent.first_request().session_id
        agent.set_phase(session, RankPhase.RELEASING, Milestone.DRAINED)
        cluster_ns.wait(JOBS, name, phase("Releasing"))
    return session


def test_a_restart_amid_an_agent_rollout_waits_for_the_next_agent_to_resume_the_ranks(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """`helm upgrade` rolls the operator and the agents at once: the new operator finds the job mid-cut
    while the node has no agent pod yet. Its abort waits for the next agent (its ranks may be released
    and only a rejoin rebuilds them) instead of failing the node at once."""
    a = agents.add(cluster_ns, "node-a", 1)
    session = _left_releasing(cluster_ns, s3_server, bucket, a, operator, "rolled")
    core = kubernetes.client.CoreV1Api(cluster_ns.api)
    core.delete_namespaced_pod("agent-node-a", OPERATOR_NS, grace_period_seconds=0)
    with operator():
        time.sleep(4)  # the new operator has found no agent on node-a by now
        assert not a.aborts
        # the DaemonSet's next pod, first Pending with no address: nothing can be sent to it yet
        cluster_ns.agent_pod("node-a", "", ready=False)
        time.sleep(2)
        assert not a.aborts
        status = {"phase": "Running", "podIP": a.host, "conditions": [{"type": "Ready", "status": "True"}]}
        core.patch_namespaced_pod_status("agent-node-a", OPERATOR_NS, {"status": status})
        after = cluster_ns.wait(JOBS, "rolled", phase("Failed"))
    assert after["status"]["reason"] == "OperatorRestarted", after["status"]
    assert [s for s, _ in a.aborts] == [session] and len(a.rejoins) == 1, a.aborts
    assert [row["phase"] for row in after["status"]["pods"]] == ["Resumed"], after["status"]


def test_an_agent_replaced_mid_abort_gets_the_abort_again(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """The rollout's other race: the new operator's abort reaches the old agent, which the rollout then
    replaces; its successor no longer reports the session but holds its record, and takes the abort
    again (only an abort makes it rebuild the released ranks)."""
    a = agents.add(cluster_ns, "node-a", 1)
    session = _left_releasing(cluster_ns, s3_server, bucket, a, operator, "replaced")
    a.replaced_mid_abort = True
    with operator():
        after = cluster_ns.wait(JOBS, "replaced", phase("Failed"))
    assert after["status"]["reason"] == "OperatorRestarted", after["status"]
    assert [s for s, _ in a.aborts] == [session, session], a.aborts
    assert [row["phase"] for row in after["status"]["pods"]] == ["Resumed"], after["status"]


def test_leave_running_checkpoint_committed_then_deleted(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    """A whole checkpoint: both agents stage their parts in the real S3, the operator commits the
    manifest, publishes the Checkpoint; deleting the Checkpoint removes its objects from S3."""
    config = store_config(bucket)
    ring_on_two_agents(cluster_ns, s3_server, agents, config)
    client = s3_server.client()
    with operator() as handle:
        cluster_ns.create(JOBS, job("ring-ckpt", storage(s3_server, bucket), checkpointName="ring-1st"))
        body = cluster_ns.wait(JOBS, "ring-ckpt", phase("Succeeded"), timeout=90)
        status = body["status"]
        assert status["checkpointName"] == "ring-1st" and status["manifestKey"].endswith(
            "/ring-ckpt/ring-1st.json"
        )
        assert condition(body, "Ready")["status"] == "True"
        assert [row["phase"] for row in status["pods"]] == ["Resumed", "Resumed"]
        # before the agents were called, they were let read the storage's Secret, by name, here only
        role = kubernetes.client.RbacAuthorizationV1Api(cluster_ns.api).read_namespaced_role(
            "ibckpt-agent-storage", cluster_ns.namespace
        )
        assert role.rules[0].resource_names == ["s3-creds"] and role.rules[0].verbs == ["get"]
        # Timings from the agents' reports: each fake phase takes 0.2 s; the ranks were gated from the
        # quiesce through the resume, 1.1 s by the nodes' own measure (not 6 phases' 1.2 s: the Resumed
        # barrier after the ranks run again is no pause), the upload came after.
        timings = status["timings"]
        assert timings["pauseSeconds"] == pytest.approx(1.1) and timings["dumpSeconds"] == pytest.approx(0.2)
        assert 0 < timings["uploadSeconds"] < timings["totalSeconds"], timings
        started = datetime.fromisoformat(status["startTime"].replace("Z", "+00:00"))
        ended = datetime.fromisoformat(status["completionTime"].replace("Z", "+00:00"))
        assert timings["totalSeconds"] == pytest.approx((ended - started).total_seconds(), abs=1.0)
        assert status["size"] == "391 KiB" and status["bytes"] == 400_000
        # the operator's own clock, per phase left (the agents' timings above are per node)
        assert [t["phase"] for t in status["phaseTimings"]] == [
            "Pending", "Admitted", "Quiescing", "Draining", "Releasing", "Dumping", "Uploading",
            "Committed", "Rebuilding", "Resuming",
        ]  # fmt: skip
        left = sum(t["seconds"] for t in status["phaseTimings"])
        assert left == pytest.approx(timings["totalSeconds"], abs=0.05), status["phaseTimings"]
        for row in status["pods"]:
            assert row["frozenSeconds"] == pytest.approx(1.1), row
            # its node's upload rate: at least the bytes over the slowest node's upload
            assert row["uploadBytesPerSecond"] >= int(200_000 / timings["uploadSeconds"]), row
        checkpoint = cluster_ns.wait(
            "checkpoints", "ring-1st", lambda o: bool(o.get("metadata", {}).get("finalizers"))
        )
        assert checkpoint["spec"]["timings"]["pauseSeconds"] == pytest.approx(1.1)
        assert checkpoint["spec"]["manifestKey"] == status["manifestKey"]
        assert checkpoint["spec"]["nodes"] == ["node-a", "node-b"]
        manifest = ImageStore.open(config).manifest(
            ImageStore.open(config).context.layout.ref_from_manifest_key(status["manifestKey"])  # type: ignore[arg-type]
        )
        assert sorted(rank.node or "" for rank in manifest.ranks) == ["node-a", "node-b"]
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert any("/chunks/" in k for k in keys) and status["manifestKey"] in keys
        reasons = [e.reason for e in cluster_ns.events("ring-ckpt")]
        for expected in ("Pending", "Quiescing", "Uploading", "Committed", "Rebuilding", "Succeeded"):
            assert expected in reasons, reasons

        deleted_before = _counter(handle.metrics(), "ibckpt_checkpoints_deleted_total")
        cluster_ns.delete("checkpoints", "ring-1st")
        deadline = time.monotonic() + 60
        while cluster_ns.get("checkpoints", "ring-1st") is not None:
            assert time.monotonic() < deadline, "the Checkpoint's finalizer never finished"
            time.sleep(0.3)
        left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert not [k for k in left if "/manifests/" in k or "/chunks/" in k], left
        assert any(e.reason == "ImagesDeleted" for e in cluster_ns.events("ring-1st"))

        text = handle.metrics()
    assert 'ibckpt_operations_total{kind="CheckpointJob",result="Succeeded"}' in text
    assert 'ibckpt_phase_duration_seconds_count{kind="CheckpointJob",phase="Quiescing"}' in text
    assert "ibckpt_checkpoint_bytes_total" in text
    # the registry is the test process's: other tests' deletions count too
    assert _counter(text, "ibckpt_checkpoints_deleted_total") == deleted_before + 1
    assert "ibckpt_operator_leader 1.0" in text


def test_metrics_count_failures_by_reason(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    creds(cluster_ns, s3_server)
    with operator() as handle:
        cluster_ns.create(JOBS, job("counted", storage(s3_server, bucket), labels={"app": "none"}))
        cluster_ns.wait(JOBS, "counted", phase("Failed"))
        text = handle.metrics()
    assert 'ibckpt_failures_total{kind="CheckpointJob",reason="NoPods"}' in text
    assert 'ibckpt_operations_total{kind="CheckpointJob",result="Failed"}' in text


def test_one_active_operator_holds_the_lease(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    """While another replica renews the Lease, this one touches nothing; once it stops, this one leads."""
    coordination = kubernetes.client.CoordinationV1Api(cluster_ns.api)
    name = "lease-test-" + cluster_ns.namespace
    now = datetime.now(UTC)
    coordination.create_namespaced_lease(OPERATOR_NS, {
        "metadata": {"name": name},
        "spec": {"holderIdentity": "other-replica", "leaseDurationSeconds": 6, "acquireTime": now.isoformat(),
                 "renewTime": now.isoformat()},
    })  # fmt: skip
    creds(cluster_ns, s3_server)
    cluster_ns.create(JOBS, job("led", storage(s3_server, bucket), labels={"app": "none"}))
    with operator(lease_name=name):
        # The other replica renews for a while: nothing is written to the job meanwhile.
        for _ in range(4):
            coordination.patch_namespaced_lease(
                name, OPERATOR_NS, {"spec": {"renewTime": datetime.now(UTC).isoformat()}}
            )
            time.sleep(1.5)
            assert not (cluster_ns.get(JOBS, "led") or {}).get("status"), "a follower touched the job"
        body = cluster_ns.wait(JOBS, "led", phase("Failed"), timeout=40)
        lease = coordination.read_namespaced_lease(name, OPERATOR_NS)
        assert lease.spec.holder_identity == "test-operator" and lease.spec.lease_transitions == 1
    assert body["status"]["reason"] == "NoPods"
    released = coordination.read_namespaced_lease(name, OPERATOR_NS)
    assert not released.spec.holder_identity  # given up at a clean exit
    assert datetime.now(UTC) - now < timedelta(minutes=2)


def test_preflight_refusal_fails_with_the_agents_reason(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    a = agents.add(cluster_ns, "node-a", 1, "refuse")
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job("refused", storage(s3_server, bucket)))
        body = cluster_ns.wait(JOBS, "refused", phase("Failed"))
    assert_failed(cluster_ns, body, "PreflightRefused", "unsupported verb ibv_alloc_dm", "node-a")
    assert not s3_server.client().list_objects_v2(Bucket=bucket).get("Contents")  # nothing stored


def test_stop_mode_deletes_the_sources_only_after_the_commit(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    pod = cluster_ns.pod("ring-0", "node-a", {"app": "ring"})
    a.register(pod, cluster_ns.namespace)
    creds(cluster_ns, s3_server)
    with operator():
        cluster_ns.create(JOBS, job("move", storage(s3_server, bucket), mode="Stop"))
        body = cluster_ns.wait(JOBS, "move", phase("Succeeded"), timeout=90)
    assert a.requests[0].mode == "Hold"  # the agent keeps the ranks (released) until the commit
    assert body["status"]["manifestKey"] and [r["phase"] for r in body["status"]["pods"]] == ["Killed"]
    source = cluster_ns.core.read_namespaced_pod("ring-0", cluster_ns.namespace)  # no kubelet: Terminating
    assert source.metadata.deletion_timestamp is not None and source.metadata.uid == pod["uid"]
    checkpoint = cluster_ns.get("checkpoints", body["status"]["checkpointName"])
    assert checkpoint is not None and checkpoint["spec"]["mode"] == "Stop"
    reasons = {e.reason for e in cluster_ns.events("move")}
    assert {"Committed", "Stopped", "Succeeded"} <= reasons  # the machine orders them (its own tests)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert body["status"]["manifestKey"] in keys


def test_checkpoint_storage_ready_condition(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any
) -> None:
    creds(cluster_ns, s3_server)
    creds(cluster_ns, s3_server, "wrong", secret_key="not-the-secret-key")

    def storage_object(name: str, secret: str) -> dict[str, Any]:
        return {"apiVersion": "ibckpt.io/v1alpha1", "kind": "CheckpointStorage", "metadata": {"name": name},
                "spec": storage(s3_server, bucket, secret=secret)}  # fmt: skip

    def ready(body: dict[str, Any]) -> str | None:
        found = [c for c in (body.get("status") or {}).get("conditions") or () if c["type"] == "Ready"]
        return found[0]["status"] if found else None

    with operator():
        cluster_ns.create("checkpointstorages", storage_object("good", "s3-creds"))
        cluster_ns.create("checkpointstorages", storage_object("bad", "wrong"))
        good = cluster_ns.wait("checkpointstorages", "good", lambda o: ready(o) is not None)
        bad = cluster_ns.wait("checkpointstorages", "bad", lambda o: ready(o) is not None)
        # A job naming the good storage by reference gets past the storage check (to NoPods).
        body = job("viaref", {}, labels={"app": "none"})
        body["spec"] = {"selector": body["spec"]["selector"], "storageRef": {"name": "good"}}
        cluster_ns.create(JOBS, body)
        assert cluster_ns.wait(JOBS, "viaref", phase("Failed"))["status"]["reason"] == "NoPods"
    assert ready(good) == "True" and good["status"]["lastCheckedTime"]
    assert ready(bad) == "False" and condition(bad, "Ready")["reason"] == "StorageCredentialsRejected"
    assert "not-the-secret-key" not in str(bad)


def _counter(metrics: str, name: str) -> float:
    """A counter without labels from a /metrics page (0 when it was never incremented)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_checkpoint_whose_store_hangs_is_deleted_within_its_bound(
    cluster_ns: Cluster, s3_server: S3Server, s3_gate: Gate, bucket: str, operator: Any, monkeypatch: Any
) -> None:
    """The images' deletion (the finalizer) waits for a store that never answers only for its bound, each
    try: then the Checkpoint goes, with ImagesNotDeleted, and its namespace can go too."""
    from ibckpt_operator.handlers import checkpoint as handlers

    monkeypatch.setattr(handlers, "DELETE_SECONDS", 2.0)
    monkeypatch.setattr(handlers, "DELETE_READ_TIMEOUT", 1.0)
    monkeypatch.setattr(handlers, "DELETE_RETRIES", 1)
    cluster_ns.s3_secret(s3_server)
    where = cluster_ns.s3_location(s3_server, bucket) | {"endpoint": f"http://127.0.0.1:{s3_gate.port}"}
    name = "hung-1"
    with operator():
        cluster_ns.create("checkpoints", {
            "apiVersion": "ibckpt.io/v1alpha1", "kind": "Checkpoint", "metadata": {"name": name},
            "spec": {"manifestKey": "ibckpt/v1/manifests/ns/job/hung-1.json", "storage": where,
                     "jobName": f"{cluster_ns.namespace}/job", "checkpointId": name, "pods": []},
        })  # fmt: skip
        cluster_ns.wait(
            "checkpoints", name, lambda body: bool(body["metadata"].get("finalizers")), timeout=30
        )
        s3_gate.stall()  # every request waits, as on a store that hangs
        try:
            began = time.monotonic()
            cluster_ns.delete("checkpoints", name)
            while cluster_ns.get("checkpoints", name) is not None:
                assert time.monotonic() - began < 45, "the finalizer waited on the store past its bound"
                time.sleep(0.5)
            [event] = [e for e in cluster_ns.events(name) if e.reason == "ImagesNotDeleted"]
            assert "gave up after 2 tries" in event.message and "did not answer within 2s" in event.message
        finally:
            s3_gate.mend()
