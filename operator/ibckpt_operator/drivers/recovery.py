"""The recovery pass of one CheckpointSchedule's controller (drivers/schedule.py runs it under its lock,
after the drain's): observe the workload's pods and nodes, feed the recovery machine, write status, run
the actions. docs/recovery.md."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ibckpt.api import CHECKPOINT, RESTORE_JOB, CheckpointScheduleSpec, CheckpointScheduleStatus, PodTemplate
from ibckpt_operator import metrics
from ibckpt_operator.cluster import bindings, schedules
from ibckpt_operator.cluster import recovery as cluster
from ibckpt_operator.cluster.kube import ApiException, api_message
from ibckpt_operator.cluster.selection import workload_pods
from ibckpt_operator.machine.core import Action, EmitEvent, Event, OperatorRestarted, Tick
from ibckpt_operator.machine.podtemplate import controller_reference, sanitize, scratch_pod
from ibckpt_operator.machine.recovery import (
    ACTIVE,
    BarePodsCreated,
    CancelRestore,
    Observation,
    RecordRecovery,
    RecoveryConfig,
    RecoveryMachine,
    RecoveryPhase,
    RecoveryState,
    RecreatePods,
    RemovePods,
    StartRecoveryRestore,
    StopPods,
)

if TYPE_CHECKING:
    from ibckpt_operator.drivers.schedule import ScheduleController

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, owner: ScheduleController) -> None:
        self.owner = owner
        self.state: RecoveryState | None = None
        self.controllers: dict[str, str] = {}  # source pod uid -> its renaming controller's uid
        self.templates: dict[str, PodTemplate] = {}  # bare source pod uid -> its template (from scratch)
        self.restarted = False

    @property
    def watching(self) -> bool:
        """The watches poke this controller: its spec asks for recovery, or one runs."""
        spec = (self.owner.live.get("spec") or {}).get("recovery")
        return self.active or (isinstance(spec, dict) and spec.get("enabled", True) is not False)

    @property
    def active(self) -> bool:
        return self.state is not None and self.state.phase in ACTIVE

    def read_back(self, status: CheckpointScheduleStatus) -> None:
        self.state = cluster.recovery_state(self.owner.name, status)
        self.controllers = cluster.source_controllers(status)
        self.templates = cluster.scratch_templates(status)
        self.restarted = self.state is not None

    def claim(self, pod: bindings.NewPod) -> bindings.Claim | None:
        if self.state is None:
            return None
        owner = self.owner
        return cluster.refusal(self.state, pod, owner.namespace, owner.name, self.controllers)

    def note(self) -> str | None:
        """The schedule's message while a recovery runs or after one that did not bring the job back."""
        if self.state is None or self.state.phase in (RecoveryPhase.IDLE, RecoveryPhase.RECOVERED):
            return None
        return self.state.message

    def status(self) -> dict[str, object]:
        if self.state is None:
            return {}
        return cluster.recovery_status(self.state, self.controllers, self.templates)

    async def step(self, spec: CheckpointScheduleSpec, busy: bool, now: float) -> float | None:
        owner, kube = self.owner, self.owner.rt.kube
        if spec.recovery is None or not spec.recovery.enabled:
            if self.state is not None and not self.active:
                self.state = None  # protection ended: the status fields go with it
            elif self.active:
                log.warning("%s: recovery disabled while one runs; it goes on to its end", owner.key)
            if self.state is None:
                metrics.RECOVERING.labels(owner.key).set(0)
                return None
        machine = RecoveryMachine(
            RecoveryConfig.from_protection(spec.recovery) if spec.recovery else RecoveryConfig()
        )
        events: list[Event] = []
        if self.state is None:
            self.state = machine.start(owner.name).state
        elif self.restarted:
            self.restarted = False
            events.append(OperatorRestarted())
        template = spec.template
        pods = await workload_pods(kube, owner.namespace, template.selector, template.workload_ref)
        if self.state.phase not in ACTIVE:
            for pod in pods:  # renaming controllers (a Job) of the members, kept for the claims
                uid = pod["metadata"]["uid"]
                ref = controller_reference(pod) or {}
                if ref.get("uid") and ref.get("kind") not in bindings.NAME_KEEPING_KINDS:
                    self.controllers[uid] = str(ref["uid"])
        else:  # the sources, wherever they are (a selector may no longer match a pod being deleted)
            uids = {p.uid for p in self.state.sources}
            pods = [p for p in pods if p["metadata"]["uid"] in uids] + await self._sources_elsewhere(pods)
        health, nodes = await cluster.observe(kube, pods)
        hint = await cluster.latest_checkpoint(kube, owner.namespace, owner.name)
        events.append(Observation(health, nodes, hint, busy))
        if self.state.restore_job is not None and self.state.phase in ACTIVE:
            job = await kube.get_custom(RESTORE_JOB.plural, owner.namespace, self.state.restore_job)
            events += await cluster.restore_events(kube, owner.namespace, self.state.restore_job, job)
        events.append(Tick())
        wake_at = None
        for event in events:
            transition = machine.handle(self.state, event, now)
            changed = transition.state != self.state
            self.state = transition.state
            self._keep_templates(pods)  # in the status written next, before the pods are stopped
            if changed:
                await owner.write_status(spec, now)  # before the actions: the job's name is in it
            await self._run(transition.actions)
            if any(isinstance(action, RecreatePods) for action in transition.actions):
                events.append(BarePodsCreated())  # handled in this loop: the templates leave status
            wake_at = transition.wake_at
        metrics.RECOVERING.labels(owner.key).set(1 if self.active else 0)
        return wake_at

    def _keep_templates(self, pods: list[dict[str, Any]]) -> None:
        """The templates of the bare sources a recovery from scratch will create again, taken from the
        pods of this pass (a recovery begins on a pass that saw them)."""
        assert self.state is not None
        wanted = {pod.uid for pod in self.state.bare}
        self.templates = {uid: t for uid, t in self.templates.items() if uid in wanted}
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if uid in wanted and uid not in self.templates:
                self.templates[uid] = sanitize(pod)

    async def _recreate(self, action: RecreatePods) -> None:
        owner = self.owner
        for pod in action.pods:
            template = self.templates.get(pod.uid)
            if template is None:
                message = f"no template of bare pod {pod.name} was kept: it is not created again"
                log.warning("%s: %s", owner.key, message)
                await owner.event("Warning", "RecreateFailed", message)
                continue
            body = scratch_pod(template, name=pod.name, namespace=owner.namespace)
            try:
                uid = await owner.rt.kube.create_pod(owner.namespace, body)
            except ApiException as error:
                if error.status != 409:
                    message = f"creating pod {pod.name} again from scratch failed: {api_message(error)}"
                    log.warning("%s: %s", owner.key, message)
                    await owner.event("Warning", "RecreateFailed", message)
                continue  # 409: it exists already (an earlier pass, or someone else made it)
            log.info("%s: created bare pod %s again from scratch (uid %s)", owner.key, pod.name, uid)

    async def _sources_elsewhere(self, matched: list[dict[str, object]]) -> list[dict[str, object]]:
        assert self.state is not None
        seen = {p["metadata"]["uid"] for p in matched}  # type: ignore[index]
        found = []
        for source in self.state.sources:
            if source.uid in seen:
                continue
            pod = await self.owner.rt.kube.get_pod(self.owner.namespace, source.name)
            if pod is not None and pod.get("metadata", {}).get("uid") == source.uid:
                found.append(pod)
        return found

    async def _run(self, actions: tuple[Action, ...]) -> None:
        owner, kube = self.owner, self.owner.rt.kube
        for action in actions:
            if isinstance(action, EmitEvent):
                await owner.event(action.type, action.reason, action.message)
                log.log(logging.WARNING if action.type == "Warning" else logging.INFO, "%s: %s: %s",
                        owner.key, action.reason, action.message)  # fmt: skip
            elif isinstance(action, StopPods):
                for pod in action.pods:
                    await kube.delete_pod(owner.namespace, pod.name, pod.uid)
            elif isinstance(action, RecreatePods):
                await self._recreate(action)
            elif isinstance(action, RemovePods):
                for pod in action.pods:
                    if await kube.delete_pod(owner.namespace, pod.name, pod.uid, grace_seconds=0):
                        log.info("%s: removed fenced pod %s (%s)", owner.key, pod.name, pod.node)
            elif isinstance(action, StartRecoveryRestore):
                checkpoint = None
                if action.checkpoint:
                    checkpoint = await kube.get_custom(CHECKPOINT.plural, owner.namespace, action.checkpoint)
                by_controller = schedules.restored_by_controller(checkpoint)
                body = cluster.restore_job_body(owner.body(), action.job, action.avoid_nodes, by_controller)
                await kube.create_custom(RESTORE_JOB.plural, owner.namespace, body)
            elif isinstance(action, CancelRestore):
                await schedules.delete_custom(kube, RESTORE_JOB.plural, owner.namespace, action.job)
            elif isinstance(action, RecordRecovery):
                metrics.record_recovery(owner.key, action.outcome, action.seconds, action.work_lost)
            else:
                log.warning("%s: no side effect for %r", owner.key, action)
