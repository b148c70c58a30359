"""One CheckpointSchedule's controller: the periodic machine and, with `spec.drain`, the drain machine of
its workload, fed from the cluster on every pass, their actions run, their state written to status.

A pass is: observe (the active job, the retention view, the members and the drained nodes, the
migration's jobs) -> feed the machines -> write status -> run the actions. Passes are serialised by a lock,
so the eviction webhook (`answer_eviction`) feeds the drain machine between two passes, never inside one.
The handler (handlers/schedule.py) runs `run()` as a kopf daemon; watches poke it (`poke`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ibckpt.api import (
    CHECKPOINT,
    CHECKPOINT_JOB,
    CHECKPOINT_SCHEDULE,
    RESTORE_JOB,
    CheckpointScheduleSpec,
    CheckpointScheduleStatus,
    Condition,
)
from ibckpt_operator import metrics
from ibckpt_operator.cluster import bindings, drains, protection, schedules, sources
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.cluster.selection import select_pods
from ibckpt_operator.config import current
from ibckpt_operator.drivers.recovery import Recovery
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine.core import Action, EmitEvent, Event, OperatorRestarted, PodRef, Tick
from ibckpt_operator.machine.drain import (
    AT_REST,
    CancelCheckpointJob,
    CreateMigrationCheckpoint,
    DrainConfig,
    DrainMachine,
    DrainPhase,
    DrainState,
    EnsurePdb,
    EvictionAnswer,
    EvictionRequested,
    NodeDraining,
    NodeUncordoned,
    PdbRelaxed,
    RecordMigration,
    RelaxPdb,
    StartRestore,
    answer_eviction,
)
from ibckpt_operator.machine.schedule import (
    CreateCheckpointJob,
    DeleteCheckpoint,
    DeleteCheckpointJob,
    JobFinished,
    ScheduleMachine,
    SchedulePolicy,
    ScheduleState,
)
from ibckpt_operator.machine.status import condition as status_condition
from ibckpt_operator.machine.status import to_time

log = logging.getLogger(__name__)
StopWaiter = Callable[[], Awaitable[str | None]]

# namespace/name -> the running controller (the webhook and the watches find theirs here).
CONTROLLERS: dict[str, ScheduleController] = {}


# The drain is held (the DRAIN_HELD metric): from the hold to the release.
HOLDING_PHASES = frozenset(
    {DrainPhase.HOLDING, DrainPhase.CHECKPOINTING, DrainPhase.COMMITTED, DrainPhase.HELD}
)
SOURCES_POLL_SECONDS = 3.0  # while a drain's restore waits for the killed source pods to go


class ScheduleController:
    def __init__(self, rt: Runtime, live: Any) -> None:
        self.rt = rt
        self.live = live  # kopf's live body: the newest spec on every pass
        meta = live["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.key = f"{self.namespace}/{self.name}"
        self.lock = asyncio.Lock()
        self.poked = asyncio.Event()
        self.schedule: ScheduleState | None = None
        self.drain: DrainState | None = None
        self.members: tuple[PodRef, ...] = ()
        self.controllers: dict[str, str] = {}  # pod uid -> its renaming controller's uid (a Job's)
        self.seen_draining: set[str] = set()
        self.waiting_for: list[str] = []  # source pods a restore waits for
        self.protected_by: str | None = None
        self.kept: int | None = None
        self.pruned = 0
        self.last_prune: float | None = None
        self.invalid: str | None = None
        self.written: Body | None = None
        self.started = False
        self.restarted = (False, False)  # (schedule, drain) states were read back from status
        self.recovery = Recovery(self)

    # -- what the rest of the operator calls

    def poke(self) -> None:
        self.poked.set()

    def body(self) -> Body:
        return {
            "apiVersion": self.live.get("apiVersion"),
            "kind": self.live.get("kind"),
            "metadata": dict(self.live["metadata"]),
        }

    def spec(self) -> CheckpointScheduleSpec:
        return CheckpointScheduleSpec.from_wire(dict(self.live.get("spec") or {}))

    def claim(self, pod: bindings.NewPod) -> bindings.Claim | None:
        """A new pod a migration or a recovery under way refuses (drains.refusal), if any."""
        if self.drain is None:
            return self.recovery.claim(pod)
        return drains.refusal(self.drain, pod, self.namespace, self.name, self.controllers) or (
            self.recovery.claim(pod)
        )

    def protects(self, pod_uid: str) -> bool:
        return self.drain is not None and any(pod.uid == pod_uid for pod in self.members)

    async def answer_eviction(self, pod: PodRef) -> EvictionAnswer:
        """Feed the eviction to the drain machine first (so the first one starts the hold), then answer
        from the new state."""
        async with self.lock:
            spec = self.spec()
            if self.drain is None or spec.drain is None:
                return EvictionAnswer(True)
            config = DrainConfig.from_protection(spec.drain)
            machine = DrainMachine(config)
            now = time.time()
            transition = machine.handle(self.drain, EvictionRequested(pod, self.members), now)
            await self._drain_apply(spec, machine, transition.state, transition.actions, now)
            await self._write_status(spec, now)
            return answer_eviction(self.drain, pod.uid, time.time(), config)

    # -- the loop

    async def run(self, stop: StopWaiter) -> None:
        CONTROLLERS[self.key] = self
        bindings.register(self)
        try:
            while True:
                async with self.lock:
                    wake_at = await self.step()
                why = await self._wait(wake_at, stop)
                if why is not None:
                    return
        finally:
            if CONTROLLERS.get(self.key) is self:
                del CONTROLLERS[self.key]

    async def _wait(self, wake_at: float | None, stop: StopWaiter) -> str | None:
        timeout = current().tick_seconds
        if self.waiting_for:  # no pod watch: look again soon, the restore starts once they are gone
            timeout = min(timeout, SOURCES_POLL_SECONDS)
        if wake_at is not None:
            timeout = min(timeout, max(0.0, wake_at - time.time()) + 0.05)
        poked = asyncio.ensure_future(self.poked.wait())
        stopper = asyncio.ensure_future(stop())
        try:
            await asyncio.wait({poked, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            poked.cancel()
            stopper.cancel()
        self.poked.clear()
        return stopper.result() if stopper.done() and not stopper.cancelled() else None

    async def step(self) -> float | None:
        now = time.time()
        try:
            spec = self.spec()
        except ValueError as error:
            self.invalid = f"invalid spec: {error}"
            patch = {"message": self.invalid, "conditions": [c.to_wire() for c in self._conditions(now)]}
            await self.rt.kube.patch_status(CHECKPOINT_SCHEDULE.plural, self.namespace, self.name, patch)
            return None
        self.invalid = None
        status = CheckpointScheduleStatus.from_wire(dict(self.live.get("status") or {}))
        if not self.started:
            # Both states are read back before anything is written: a status write carries both.
            self.started = True
            self.schedule = schedules.schedule_state(self.name, status)
            self.drain = drains.drain_state(self.name, status)
            self.controllers = drains.source_controllers(status)
            self.protected_by, self.pruned = status.protected_by, status.pruned_count or 0
            self.restarted = (self.schedule is not None, self.drain is not None)
            self.recovery.read_back(status)
        wakes = [await self._periodic(spec, now)]
        wakes.append(await self._protect(spec, status, now))
        busy = self.drain is not None and self.drain.phase not in AT_REST
        wakes.append(await self.recovery.step(spec, busy, now))
        await self._write_status(spec, now)
        times = [wake for wake in wakes if wake is not None]
        return min(times) if times else None

    # -- periodic checkpoints

    async def _periodic(self, spec: CheckpointScheduleSpec, now: float) -> float | None:
        machine = ScheduleMachine(SchedulePolicy.from_spec(spec))
        events: list[Event] = []
        if self.schedule is None:
            transition = machine.start(self.name, now)
            self.schedule = transition.state
            await self._write_status(spec, now)
            await self._run(spec, transition.actions, now)
        elif self.restarted[0]:
            self.restarted = (False, self.restarted[1])
            events.append(OperatorRestarted())
        assert self.schedule is not None
        finished = None
        if self.schedule.active_job is not None:
            finished = await schedules.job_outcome(self.rt.kube, self.namespace, self.schedule.active_job)
            if finished is not None:
                events.append(finished)
        if not self.recovery.active:  # no checkpoint of a job being recovered: the next Tick fires once
            events.append(Tick())  # recomputes the interval: a spec change or a new cost applies at once
        wake_at = None
        for event in events:
            transition = machine.handle(self.schedule, event, now)
            self.schedule = transition.state
            await self._write_status(spec, now)  # before the actions: the job's name is in it
            if isinstance(event, JobFinished):
                await self._finished(event, transition.state)
            await self._run(spec, transition.actions, now)
            wake_at = transition.wake_at
        metrics.record_schedule(self.key, self.schedule.interval, self.schedule.cost)
        if finished is not None or self.kept is None:
            await self._prune(spec, machine, now)
        return wake_at

    async def _finished(self, event: JobFinished, state: ScheduleState) -> None:
        if not event.succeeded:
            return  # the machine warns
        cost = "unmeasured" if event.seconds is None else f"{event.seconds:.1f}s"
        interval = "none" if state.interval is None else f"{state.interval:.0f}s"
        await self._event(
            "Normal", "CheckpointSucceeded", f"{event.name} succeeded; cost {cost}, interval now {interval}"
        )

    async def _prune(self, spec: CheckpointScheduleSpec, machine: ScheduleMachine, now: float) -> None:
        infos = await schedules.retention_view(self.rt.kube, self.namespace, self.name)
        actions = machine.prune(infos, now)
        pruned = {action.name for action in actions if isinstance(action, DeleteCheckpoint)}
        self.kept = len(infos) - len(pruned)
        self.last_prune = now
        await self._run(spec, actions, now)
        jobs = await schedules.job_history(self.rt.kube, self.namespace, self.name)
        await self._run(spec, machine.prune_jobs(jobs, self._jobs_in_use()), now)

    def _jobs_in_use(self) -> frozenset[str]:
        """The jobs the machines still read: the running one, and those of a migration."""
        names = {self.schedule.active_job if self.schedule else None}
        if self.drain is not None:
            names |= {self.drain.checkpoint_job, self.drain.cancelled_job}
        return frozenset(name for name in names if name)

    # -- drain protection

    async def _protect(
        self, spec: CheckpointScheduleSpec, status: CheckpointScheduleStatus, now: float
    ) -> float | None:
        if spec.drain is None or not spec.drain.enabled:
            was_protected = self.drain is not None or status.drain_phase is not None or status.protected_by
            if was_protected and await protection.relax_pdb(self.rt.kube, self.namespace, self.name):
                await self._event("Normal", "ProtectionEnded", "drain protection removed: PDB deleted")
            self.drain, self.protected_by, self.members = None, None, ()
            metrics.DRAIN_HELD.labels(self.key).set(0)
            return None
        machine = DrainMachine(DrainConfig.from_protection(spec.drain))
        controllers: dict[str, str] = {}
        self.members = await select_pods(
            self.rt.kube,
            self.namespace,
            spec.template.selector,
            spec.template.workload_ref,
            controllers,
            bindings.NAME_KEEPING_KINDS,
        )
        # A migration keeps its sources' controllers after the commit deleted them (status shows them).
        if self.drain is None or self.drain.phase in AT_REST:
            sources = {pod.uid for pod in self.drain.sources} if self.drain else set()
            kept = {uid: owner for uid, owner in self.controllers.items() if uid in sources}
            self.controllers = {**kept, **controllers}
        else:
            self.controllers = {**self.controllers, **controllers}
        events: list[Event] = []
        if self.drain is None:
            transition = machine.start(self.name)
            await self._drain_apply(spec, machine, transition.state, transition.actions, now)
        elif self.restarted[1]:
            self.restarted = (self.restarted[0], False)
            events.append(OperatorRestarted())
        elif self.drain.phase in (DrainPhase.IDLE, DrainPhase.DONE, DrainPhase.FAILED):
            # The members change (a restore, a controller's new pod): keep the PDB over them.
            self.protected_by = await self._ensure_pdb(spec)
        elif self.drain.phase is DrainPhase.LOST and self.members:
            # The drain took the sources; the pods started again from scratch are protected again.
            sources = {pod.uid for pod in self.drain.sources}
            if not any(pod.uid in sources for pod in self.members):
                self.protected_by = await self._ensure_pdb(spec)
        assert self.drain is not None
        draining = drains.draining_nodes()
        for node in sorted({pod.node for pod in self.members if pod.node in draining}):
            if node not in self.drain.nodes and not self.recovery.active:  # a recovery moves the job
                self.seen_draining.add(node)
                events.append(NodeDraining(node, self.members))
        # Only a node seen drained can be uncordoned: a migration an eviction started (its pod's node was
        # never cordoned) is not cancelled by the node staying schedulable.
        since = self.drain.held_since or now
        self.seen_draining |= set(self.drain.nodes) & draining
        self.seen_draining |= {n for n in self.drain.nodes if drains.DRAINED_AT.get(n, 0.0) >= since}
        for node in self.drain.nodes:
            if node not in draining and node in self.seen_draining:
                self.seen_draining.discard(node)
                events.append(NodeUncordoned(node))
        wake_at = None
        for event in [*events, *await self._migration_events(), Tick()]:
            transition = machine.handle(self.drain, event, now)
            await self._drain_apply(spec, machine, transition.state, transition.actions, now)
            wake_at = transition.wake_at
        metrics.DRAIN_HELD.labels(self.key).set(1 if self.drain.phase in HOLDING_PHASES else 0)
        return wake_at

    async def _migration_events(self) -> list[Event]:
        assert self.drain is not None
        kube, events = self.rt.kube, []
        for job in {self.drain.checkpoint_job, self.drain.cancelled_job} - {None}:
            assert job is not None
            body = await kube.get_custom(CHECKPOINT_JOB.plural, self.namespace, job)
            if body is None and job == self.drain.cancelled_job:
                # A cancelled job is deleted: whether it committed anyway shows in its Checkpoint.
                checkpoint = await kube.get_custom(CHECKPOINT.plural, self.namespace, job)
                if checkpoint is not None:
                    body = {"status": {"phase": "Succeeded", "checkpointName": job, "manifestKey": "-"}}
            elif body is None and self.drain.phase is DrainPhase.COMMITTED:
                body = {"status": {"phase": "Succeeded", "checkpointName": self.drain.checkpoint}}
            events += drains.checkpoint_job_events(job, body)
        if self.drain.restore_job is not None:
            body = await kube.get_custom(RESTORE_JOB.plural, self.namespace, self.drain.restore_job)
            if body is None and self.drain.phase is DrainPhase.RESTORING and self.drain.checkpoint:
                await self._start_restore(
                    StartRestore(self.drain.restore_job, self.drain.checkpoint, self.drain.nodes)
                )
            events += drains.restore_job_events(self.drain.restore_job, body)
        return events

    async def _drain_apply(
        self,
        spec: CheckpointScheduleSpec,
        machine: DrainMachine,
        state: DrainState,
        actions: tuple[Action, ...],
        now: float,
    ) -> None:
        """Status first (the names of what the actions create are in it), then the actions; a PDB relaxed
        is fed back at once (PdbRelaxed), which may start the restore."""
        before = self.drain
        self.drain = state
        if before is None or before != state:
            await self._write_status(spec, now)
        relaxed = False
        for action in actions:
            if isinstance(action, RelaxPdb):
                relaxed = True
            await self._run(spec, (action,), now)
        if relaxed and self.drain.phase is DrainPhase.RELEASING:
            transition = machine.handle(self.drain, PdbRelaxed(), now)
            await self._drain_apply(spec, machine, transition.state, transition.actions, now)

    async def _ensure_pdb(self, spec: CheckpointScheduleSpec) -> str:
        selector = await protection.pod_selector(
            self.rt.kube, self.namespace, self.name, spec.template, self.members
        )
        return await protection.ensure_pdb(self.rt.kube, self.body(), selector)

    # -- side effects

    async def _run(self, spec: CheckpointScheduleSpec, actions: tuple[Action, ...], now: float) -> None:
        kube = self.rt.kube
        for action in actions:
            if isinstance(action, EmitEvent):
                await self._event(action.type, action.reason, action.message)
                if action.reason == "CheckpointSkipped":
                    metrics.SCHEDULE_SKIPPED.labels(self.key).inc()
            elif isinstance(action, CreateCheckpointJob):
                body = schedules.checkpoint_job_body(self.body(), spec, action.name)
                await kube.create_custom(CHECKPOINT_JOB.plural, self.namespace, body)
            elif isinstance(action, DeleteCheckpoint):
                if await schedules.delete_checkpoint(kube, self.namespace, action.name):
                    self.pruned += 1
                    metrics.SCHEDULE_PRUNED.labels(self.key).inc()
            elif isinstance(action, DeleteCheckpointJob):
                await schedules.delete_custom(kube, CHECKPOINT_JOB.plural, self.namespace, action.name)
                log.info("%s: deleted CheckpointJob %s (%s)", self.key, action.name, action.reason)
            elif isinstance(action, EnsurePdb):
                self.protected_by = await self._ensure_pdb(spec)
            elif isinstance(action, RelaxPdb):
                await protection.relax_pdb(kube, self.namespace, self.name)
                self.protected_by = None
            elif isinstance(action, CreateMigrationCheckpoint):
                body = schedules.checkpoint_job_body(
                    self.body(), spec, action.job, stop_into=action.checkpoint
                )
                await kube.create_custom(CHECKPOINT_JOB.plural, self.namespace, body)
            elif isinstance(action, CancelCheckpointJob):
                await schedules.delete_custom(kube, CHECKPOINT_JOB.plural, self.namespace, action.job)
            elif isinstance(action, StartRestore):
                await self._start_restore(action)
            elif isinstance(action, RecordMigration):
                metrics.record_migration(self.key, action.outcome, action.seconds)
                message = self.drain.message if self.drain is not None else ""
                log.info(
                    "%s: migration %s after %.0fs: %s", self.key, action.outcome, action.seconds, message
                )
            else:
                log.warning("%s: no side effect for %r", self.key, action)

    async def _start_restore(self, action: StartRestore) -> None:
        """The RestoreJob that brings the job back. Pods a StatefulSet owns are created again by it under
        their names: the RestoreJob (podsCreatedBy: Controller) stages their images at once, and the
        webhook binds the controller's new pods (bindings.py). Other pods are created by the RestoreJob
        under their names, so it is created only once no source pod is left (a killed pod may take its
        grace period to go, and its kubelet's cleanup after it); until then every pass tries again
        (create-if-absent by name). A source its kubelet reports ended is removed at once (sources.py)."""
        assert self.drain is not None
        checkpoint = await self.rt.kube.get_custom(CHECKPOINT.plural, self.namespace, action.checkpoint)
        by_controller = schedules.restored_by_controller(checkpoint)
        left = []
        for pod in () if by_controller else self.drain.sources:
            found = await self.rt.kube.get_pod(self.namespace, pod.name) or {}
            if found.get("metadata", {}).get("uid") != pod.uid:
                continue
            if await sources.remove_if_ended(self.rt.kube, self.namespace, found, pod.uid):
                await self._event("Normal", "SourceRemoved", sources.removed_message(pod.name))
            else:
                left.append(pod.name)
        if left:
            if self.waiting_for != left:
                self.waiting_for = left
                await self._event(
                    "Normal", "WaitingForSources", f"restore starts once {', '.join(left)} are gone"
                )
            return
        self.waiting_for = []
        body = schedules.restore_job_body(
            self.body(), action.job, action.checkpoint, action.avoid_nodes, by_controller=by_controller
        )
        await self.rt.kube.create_custom(RESTORE_JOB.plural, self.namespace, body)

    async def _event(self, type_: str, reason: str, message: str) -> None:
        await self.rt.kube.post_event(self.body(), type_, reason, message)

    async def event(self, type_: str, reason: str, message: str) -> None:
        await self._event(type_, reason, message)

    async def write_status(self, spec: CheckpointScheduleSpec | None, now: float) -> None:
        await self._write_status(spec, now)

    # -- status

    async def _write_status(self, spec: CheckpointScheduleSpec | None, now: float) -> None:
        fields: dict[str, Any] = {"observed_generation": self.live["metadata"].get("generation")}
        if spec is not None and self.schedule is not None:
            fields.update(schedules.schedule_status(spec, self.schedule))
        if self.drain is not None:
            fields.update(drains.drain_status(self.drain, self.controllers))
        fields.update(self.recovery.status())
        fields.update(
            protected_by=self.protected_by,
            kept_count=self.kept,
            pruned_count=self.pruned or None,
            last_prune_time=to_time(self.last_prune),
        )
        fields["message"] = self.invalid or self._message()
        fields["conditions"] = self._conditions(now)
        body = schedules.status_patch(CheckpointScheduleStatus(**fields))
        if body == self.written:
            return
        await self.rt.kube.patch_status(CHECKPOINT_SCHEDULE.plural, self.namespace, self.name, body)
        self.written = body

    def _message(self) -> str | None:
        if (recovery := self.recovery.note()) is not None:
            return recovery
        if self.drain is not None and self.drain.phase not in (DrainPhase.IDLE, DrainPhase.DONE):
            return self.drain.message
        state = self.schedule
        if state is None or state.interval is None:
            return "drain protection only" if self.drain is not None else "suspended"
        upcoming = "-" if (at := to_time(state.next_fire)) is None else at.isoformat()
        return f"every {state.interval:.0f}s; next {upcoming}"

    def _conditions(self, now: float) -> list[Condition]:
        """Ready: the spec is valid and acted on. Progressing: a job or a migration is under way.
        DrainHeld: a drain is held (True names why)."""
        previous = [Condition.from_wire(c) for c in (self.live.get("status") or {}).get("conditions") or ()]
        generation = self.live["metadata"].get("generation")

        def condition(kind: str, true: bool, reason: str, message: str | None = None) -> Condition:
            return status_condition(
                kind, true, reason, message, generation=generation, previous=previous, now=now
            )

        if self.invalid is not None:
            return [condition("Ready", False, "InvalidSpec", self.invalid)]
        migrating = self.drain is not None and self.drain.phase not in AT_REST
        active = self.schedule is not None and self.schedule.active_job is not None
        recovering = self.recovery.active
        progressing = (
            "Recovering"
            if recovering
            else "Migrating"
            if migrating
            else "CheckpointRunning"
            if active
            else "Idle"
        )
        held = self.drain is not None and self.drain.phase is DrainPhase.HELD
        return [
            condition("Ready", True, "Scheduled"),
            condition("Progressing", migrating or active or recovering, progressing),
            condition(
                "DrainHeld",
                held,
                (self.drain.reason or "Held") if held and self.drain else "NotHeld",
                self.drain.message if held and self.drain else None,
            ),
        ]
