"""How the RestoreJob driver turns the agents' reports into PodStepDone (pure: no apiserver, no agent).

The agents are asked before the pods exist, so their reports name a rank's pod uid only once the runtime
has restored its pod: ranks are matched to pods by the Checkpoint's rank keys. Progress seen while the
pods are being created is kept for the step that wants it."""

from __future__ import annotations

import time
from typing import Any

from ibckpt.agentapi import Milestone, RankProgress, SessionKind, SessionReport, SessionState
from ibckpt.api import Checkpoint, RestorePhase
from ibckpt_operator.drivers.restorejob import RestoreJobDriver
from ibckpt_operator.machine import PodRef, RestoreState, RestoreStep
from ibckpt_operator.machine.core import Event, PodAdmitted, PodStepDone, SessionOpened
from ibckpt_operator.machine.restore import CheckpointResolved, PodCreated, PodsPlaced
from testbed.machines import T0

KEYS = {"ring-0": "ring/ring-0/main/1", "ring-1": "ring/ring-1/main/1"}


def checkpoint() -> Checkpoint:
    pods = [
        {"name": name, "uid": f"old-{name}", "node": "node-1", "ranks": [key]} for name, key in KEYS.items()
    ]
    return Checkpoint.from_wire({
        "apiVersion": "ibckpt.io/v1alpha1", "kind": "Checkpoint", "metadata": {"name": "ring-c1"},
        "spec": {"manifestKey": "m.json", "jobName": "ns/ring", "checkpointId": "c1", "mode": "Stop",
                 "storage": {"bucket": "ring-bucket", "credentialsSecretRef": {"name": "s3"}}, "pods": pods},
    })  # fmt: skip


class Job:
    """The driver without its loop: the test feeds the machine the events the driver emits."""

    def __init__(self) -> None:
        body = {"metadata": {"namespace": "ns", "name": "back", "uid": "rsj-uid"},
                "spec": {"checkpointName": "ring-c1"}}  # fmt: skip
        runtime: Any = None  # absorb and report_progress touch neither the apiserver nor the agents
        self.driver = RestoreJobDriver(runtime, body)
        self.driver.checkpoint = checkpoint()
        self.now = T0
        self.driver.state = self.driver.machine.start("r1", self.now).state

    @property
    def state(self) -> RestoreState:
        assert self.driver.state is not None
        return self.driver.state

    @property
    def step(self) -> RestoreStep:
        assert self.state.step is not None
        return RestoreStep(self.state.step.kind)

    @property
    def attempt(self) -> str:
        assert self.state.attempt is not None
        return self.state.attempt

    def send(self, event: Event) -> None:
        self.now += 1
        self.driver.state = self.driver.machine.handle(self.state, event, self.now).state

    def emitted(self) -> list[Event]:
        events = []
        while not self.driver.events.empty():
            events.append(self.driver.events.get_nowait())
        return events

    def report(self, done: dict[str, Milestone | None], uids: dict[str, str] | None = None) -> None:
        """A running session's report: each pod's ranks have passed `done` (None: not even that)."""
        uids = uids or {}
        ranks = [
            RankProgress(
                rank_key=KEYS[name], pod_uid=uids.get(name, ""), container="main", done=passed, bytes=100
            )
            for name, passed in done.items()
        ]
        report = SessionReport(session_id="rsj-r1", kind=SessionKind.RESTORE, node="node-1",
                               state=SessionState.RUNNING, ranks=ranks, started_at=time.time())  # fmt: skip
        self.driver.absorb(report)


def test_progress_seen_while_the_pods_are_created_counts_for_the_restore() -> None:
    job = Job()
    job.send(CheckpointResolved(job.attempt, tuple(PodRef(name, "", "node-1") for name in KEYS)))
    job.send(PodsPlaced(job.attempt, {"ring-0": "node-2", "ring-1": "node-2"}))
    for name in KEYS:
        job.send(PodAdmitted(job.attempt, name))
    job.send(SessionOpened(job.attempt))
    assert job.step == RestoreStep.DOWNLOAD and job.state.phase == RestorePhase.DOWNLOADING

    # No pod exists yet: the reports name no uid, the rank keys say whose ranks they are.
    job.report({"ring-0": Milestone.DOWNLOADED, "ring-1": None})
    download = job.attempt
    assert job.emitted() == [PodStepDone(download, "ring-0", bytes=100)]
    job.report({"ring-0": Milestone.DOWNLOADED, "ring-1": Milestone.DOWNLOADED})
    events = job.emitted()
    assert events == [PodStepDone(download, "ring-1", bytes=100)]  # ring-0 was told once
    job.send(PodStepDone(download, "ring-0"))
    job.send(events[0])
    assert job.step == RestoreStep.CREATE_PODS and job.state.phase == RestorePhase.RESTORING

    # ring-0 is created and restored while ring-1 is still being created: nothing to tell the creation.
    job.send(PodCreated(job.attempt, "ring-0", "new-0"))
    job.report({"ring-0": Milestone.RESTORED, "ring-1": Milestone.DOWNLOADED}, {"ring-0": "new-0"})
    assert job.emitted() == []
    job.send(PodCreated(job.attempt, "ring-1", "new-1"))
    assert job.step == RestoreStep.RESTORE

    # The restore step's effect replays what was seen: ring-0 is Restored already.
    job.driver.report_progress()
    assert job.emitted() == [PodStepDone(job.attempt, "ring-0", bytes=100)]
    job.report({"ring-0": Milestone.RESTORED, "ring-1": Milestone.RESTORED}, {"ring-0": "new-0"})
    events = job.emitted()
    assert events == [PodStepDone(job.attempt, "ring-1", bytes=100)]
    job.send(PodStepDone(job.attempt, "ring-0"))
    job.send(events[0])
    assert job.step == RestoreStep.REBUILD and job.state.phase == RestorePhase.REBUILDING


def test_a_rank_of_no_member_is_ignored() -> None:
    job = Job()
    ranks = [
        RankProgress(rank_key="other/pod-9/main/1", pod_uid="", container="main", done=Milestone.DOWNLOADED)
    ]
    job.driver.absorb(SessionReport(session_id="rsj-r1", kind=SessionKind.RESTORE, node="node-1",
                                    ranks=ranks, started_at=time.time()))  # fmt: skip
    assert job.driver.progress.reached == {} and job.emitted() == []


def test_a_restored_pod_that_failed_is_explained_in_the_runtimes_words() -> None:
    from ibckpt_operator.cluster.pods import restored_lost

    pod = PodRef("ring-0", "uid-0", "node-2")
    meta = {"name": "ring-0", "uid": "uid-0"}
    # restartPolicy Never: the container could not be created, the pod Failed without a pod-level reason
    start_error = {"terminated": {"reason": "StartError", "message": "criu failed: type NOTIFY errno 0"}}
    failed = {"metadata": meta, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "main", "state": start_error}]}}  # fmt: skip
    assert restored_lost(failed, pod) == (
        "the restored pod ring-0 failed: container main: StartError: criu failed: type NOTIFY errno 0"
    )
    evicted = {"metadata": meta, "status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"}}
    assert restored_lost(evicted, pod) == "the restored pod ring-0 failed: low memory"
    bare = {"metadata": meta, "status": {"phase": "Failed"}}
    assert restored_lost(bare, pod) == "the restored pod ring-0 failed: no reason given by the kubelet"
    assert restored_lost({"metadata": meta, "status": {"phase": "Running"}}, pod) is None
    assert restored_lost(None, pod) == "the restored pod ring-0 was deleted"
