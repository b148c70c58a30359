"""The CheckpointMachine on a fake clock (testbed.machines): `CheckpointDriver` answers the step in flight
on the happy path (tests/operator/test_checkpoint_machine.py and test_checkpoint_waits.py)."""

from __future__ import annotations

from dataclasses import replace

from ibckpt.api import CheckpointJobSpec, CheckpointMode, StorageTier
from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine import CheckpointMachine, JobConfig, JobState, JobStep, PodRef
from ibckpt_operator.machine.actions import AwaitMilestone
from ibckpt_operator.machine.checkpoint import TERMINAL, CheckpointPublished, ManifestCommitted
from ibckpt_operator.machine.core import PodAdmitted, PodsClaimed, PodsSelected, SessionOpened
from testbed.machines import MachineDriver

PODS = (
    PodRef("ring-0", "uid-0", "node-1"),
    PodRef("ring-1", "uid-1", "node-2"),
    PodRef("ring-2", "uid-2", "node-2"),
)
SPEC = CheckpointJobSpec.from_wire(
    {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}}
)
PER_POD_STEPS = {
    JobStep.PRE_DUMP,
    JobStep.QUIESCE,
    JobStep.QUIESCE_AFTER_PRE_DUMP,
    JobStep.DRAIN,
    JobStep.RELEASE,
    JobStep.DUMP,
    JobStep.UPLOAD,
    JobStep.KEEP,
    JobStep.REBUILD,
    JobStep.RESUME,
    JobStep.KILL,
    JobStep.RESUME_ALL,
}


class CheckpointDriver(MachineDriver[JobState]):
    """One CheckpointJob's machine on the fake clock."""

    def __init__(self, mode: CheckpointMode = CheckpointMode.LEAVE_RUNNING, **config: object) -> None:
        base = JobConfig.from_spec(SPEC.model_copy(update={"mode": mode}), "ring-ckpt")
        super().__init__(CheckpointMachine(replace(base, **config)), "run7", TERMINAL)  # type: ignore[arg-type]

    @property
    def step(self) -> JobStep:
        assert self.state.step is not None
        return JobStep(self.state.step.kind)

    def all_done(self) -> None:
        self.each_done("uid", 100, 0.5, after=0.1)

    def admit(self, pods: tuple[PodRef, ...] = PODS) -> None:
        self.send(PodsSelected(self.attempt, pods))
        self.send(PodsClaimed(self.attempt))
        for pod in pods:
            self.send(PodAdmitted(self.attempt, pod.uid))
        self.send(SessionOpened(self.attempt))

    def advance(self) -> None:
        step = self.step
        if step == JobStep.SELECT:
            self.send(PodsSelected(self.attempt, PODS))
        elif step == JobStep.CLAIM:
            self.send(PodsClaimed(self.attempt))
        elif step == JobStep.ADMIT:
            for pod in PODS:
                self.send(PodAdmitted(self.attempt, pod.uid))
        elif step == JobStep.OPEN_SESSION:
            self.send(SessionOpened(self.attempt))
        elif step in (JobStep.COMMIT, JobStep.VERIFY_COMMIT):
            self.send(ManifestCommitted(self.attempt, "ibckpt/v1/manifests/ns/ring/c1.json"))
        elif step == JobStep.COMMIT_IN_MEMORY:
            key = "ibckpt/v1/manifests/ns/ring/c1.json"
            self.send(ManifestCommitted(self.attempt, key, StorageTier.MEMORY))
        elif step == JobStep.PUBLISH:
            self.send(CheckpointPublished(self.attempt))
        else:
            assert step in PER_POD_STEPS
            self.all_done()

    def to_step(self, step: JobStep) -> None:
        """Drive the happy path until `step` is in flight."""
        for _ in range(50):
            if self.state.step is not None and self.step == step:
                return
            assert self.state.phase not in TERMINAL, self.phases
            self.advance()
        raise AssertionError(f"never reached step {step}: {self.phases}")

    def awaited(self) -> list[Milestone]:
        return [action.milestone for action in self.of_type(AwaitMilestone)]
