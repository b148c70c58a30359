"""One RestoreJob's driver: resolves the Checkpoint, checks its storage, places each pod, admits the
destinations (ready agent, compatible versions, no pod of that name yet), opens the coordinator session,
hands each node's agent its RestoreRequest (the pods by namespace and name: they do not exist yet), and
once every pod's images are staged creates the destination pods, then follows the agents' session
reports to Succeeded. The images are staged first because the node's runtime wrapper holds a restored
container's create only briefly while it waits for them. A failure once an agent session may exist
aborts the agents' sessions and deletes the pods this restore created (CleanUpRestore), so no part of
the job runs alone.

The machine (machine/restore.py) decides; this observes and acts. The destination pods (placement,
admission, creation, deletion) are the base class's, in restorepods.py; placement, templates and the
compatibility rules are pure (machine/restoreplan.py, machine/podtemplate.py).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Iterable

from ibckpt.agentapi import (
    RESTORE_MILESTONES,
    AgentError,
    ImageSource,
    MemoryCopyReport,
    MemoryCopySource,
    Milestone,
    PhaseTimeouts,
    RestoreRank,
    RestoreRequest,
    SecretRef,
    SessionReport,
)
from ibckpt.api import Checkpoint, MemoryReads, RestoreJobStatus, RestorePhase, SkippedCheckpoint
from ibckpt_operator.cluster import bindings, secretgrants, storage
from ibckpt_operator.cluster.agents import (
    Agent,
    agent_address,
    agent_failure,
    agents_by_node,
    each_agent,
    follow_session,
    start_when_free,
)
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.cluster.pods import restored_lost
from ibckpt_operator.drivers import memorycopies
from ibckpt_operator.drivers.progress import PodProgress
from ibckpt_operator.drivers.restorepods import RestorePodsDriver
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import PodRef, RestoreConfig, RestoreMachine, RestoreState, memorytier
from ibckpt_operator.machine.actions import (
    AdmitNodes,
    AwaitMilestone,
    CleanUpRestore,
    CreatePods,
    DownloadImages,
    OpenSession,
    PlacePods,
    ResolveCheckpoint,
)
from ibckpt_operator.machine.core import (
    Action,
    EmitEvent,
    Event,
    OperatorRestarted,
    SessionOpened,
    StepAction,
    StepFailed,
    Transition,
)
from ibckpt_operator.machine.latest import refusal
from ibckpt_operator.machine.restore import (
    STEP_LABEL,
    TERMINAL,
    CheckpointResolved,
    ImagesNearlyStaged,
    RestoreStep,
    staging_seconds_left,
)
from ibckpt_operator.machine.restoreplan import AddressConflict, AddressMove, address_map, rank_parts
from ibckpt_operator.machine.status import restore_state, restore_status

log = logging.getLogger(__name__)
LIVE_PHASES = (RestorePhase.RESTORING, RestorePhase.REBUILDING, RestorePhase.RESUMING)


class RestoreJobDriver(RestorePodsDriver):
    def __init__(self, runtime: Runtime, body: Body) -> None:
        super().__init__(runtime, body)
        self.machine = RestoreMachine(RestoreConfig.from_spec(self.spec))
        self.polled: set[str] = set()  # nodes whose session report is being followed
        self.progress = PodProgress(RESTORE_MILESTONES, Milestone.RESUMED)  # by pod name
        # latestOf: what drivers/latest.py wrote before this driver started; kept in every status written
        skipped = (body.get("status") or {}).get("skippedCheckpoints") or None
        self.skipped = [SkippedCheckpoint.from_wire(s) for s in skipped] if skipped else None
        # each node's SessionReport.memoryCopy: the chunks it read from memory copies (status.memoryReads)
        self.memory_reads: dict[str, MemoryCopyReport] = {}
        # each node's download: the seconds it still expects (machine/restore.py, "Overlap")
        self.staging_left: dict[str, float] = {}
        if self.by_controller:
            bindings.register(self)

    # -- names

    def session_id(self, run: str) -> str:
        return f"rsj-{run}"

    def claim(self, pod: bindings.NewPod) -> bindings.Claim | None:
        """Controller mode: a new pod of a member's name is refused until its images are staged, then
        bound to its node (once: a member whose pod exists is not bound again)."""
        state, name = self.state, pod.name
        if (
            not name
            or pod.namespace != self.namespace
            or state is None
            or state.phase in (*TERMINAL, RestorePhase.CLEANING_UP)
        ):
            return None
        member = next((m for m in state.members if m.pod.name == name), None)
        if member is None:
            return None
        creating = state.step is not None and state.step.kind == RestoreStep.CREATE_PODS
        if member.pod.node and not member.pod.uid and (creating or state.phase in LIVE_PHASES):
            return bindings.Binding(member.pod.node, self.checkpoint_ref, self.restored_by(state.run))
        if member.pod.uid:
            why = "its restored pod is being replaced"
        else:
            why = f"its images are not staged yet ({state.phase})"
        return bindings.Waiting(
            f"ibckpt: pod {name} is being restored from Checkpoint {self.checkpoint_ref} by RestoreJob "
            f"{self.name}, and {why}; its controller will create it again"
        )

    # -- the machine

    def begin(self, now: float) -> Transition[RestoreState]:
        state = self.read_back(RestoreJobStatus, restore_state)
        if state is None:
            return self.machine.start(secrets.token_hex(4), now)
        return self.machine.handle(state, OperatorRestarted(), now)

    def terminal(self, state: RestoreState) -> bool:
        return state.phase in TERMINAL

    def handle(self, state: RestoreState, event: Event, now: float) -> Transition[RestoreState]:
        return self.machine.handle(state, event, now)

    def status_of(self, state: RestoreState, now: float) -> RestoreJobStatus:
        status = restore_status(state, generation=self.generation, previous=self.conditions, now=now)
        update: dict[str, object] = {}
        if self.skipped:
            update["skipped_checkpoints"] = self.skipped
        read = [r for r in self.memory_reads.values() if r.chunks]
        if read:
            holders = sorted({node for r in read for node in r.node.split(",") if node})
            update["memory_reads"] = MemoryReads(
                chunks=sum(r.chunks for r in read), bytes=sum(r.bytes for r in read), holders=holders
            )
        return status.model_copy(update=update) if update else status

    def background(self) -> list[Awaitable[None]]:
        # a created pod that is deleted, replaced or fails before the restore ends is lost
        return [self.watch_pods(self.watched, restored_lost)]

    def watched(self, state: RestoreState) -> list[tuple[str, PodRef]]:
        if state.phase not in (RestorePhase.DOWNLOADING, *LIVE_PHASES):
            return []
        return [(m.pod.name, m.pod) for m in state.members if m.pod.uid]

    # -- actions

    async def execute(self, action: Action) -> None:
        if isinstance(action, EmitEvent):
            log.info("%s: %s %s: %s", self.key, action.type, action.reason, action.message)
        await super().execute(action)

    async def effect(self, action: StepAction) -> None:
        if isinstance(action, ResolveCheckpoint):
            await self.resolve(action)
        elif isinstance(action, PlacePods):
            await self.place(action)
        elif isinstance(action, AdmitNodes):
            await self.admit(action)
        elif isinstance(action, OpenSession):
            await self.open_session(action)
        elif isinstance(action, DownloadImages):
            await self.start_agents(action)
        elif isinstance(action, CreatePods):
            await self.create_pods(action)
        elif isinstance(action, CleanUpRestore):
            await self.clean_up(action)
        else:  # AwaitMilestone: the agents go on by themselves; after a restart, follow them again
            if isinstance(action, AwaitMilestone) and action.milestone == Milestone.RESUMED:
                await self.follow_again()
            self.report_progress()

    async def resolve(self, action: ResolveCheckpoint) -> None:
        checkpoint = await self.load_checkpoint()
        if checkpoint is None:
            message = f"Checkpoint {self.checkpoint_ref} does not exist"
            self.emit(StepFailed(action.attempt, "CheckpointNotFound", message))
            return
        spec = checkpoint.spec
        refused = refusal(checkpoint, self.namespace)
        if refused is not None and refused.reason == "ForeignCheckpoint":  # before its storage is read
            self.emit(StepFailed(action.attempt, refused.reason, refused.message))
            return
        # held in memory only: the restore reads no byte from S3, so S3 need not answer (docs/recovery.md)
        reach = memorytier.checkpoint_on_s3(checkpoint)
        await storage.check(self.rt.kube, self.namespace, spec.storage_ref, spec.storage, reach=reach)
        if refused is not None:
            self.emit(StepFailed(action.attempt, refused.reason, refused.message))
            return
        # Members are keyed by name: the uid a member gets is its destination pod's.
        pods = tuple(PodRef(p.name, "", p.node or "") for p in spec.pods or ())
        self.emit(CheckpointResolved(action.attempt, pods))

    async def open_session(self, action: OpenSession) -> None:
        assert self.state is not None
        t = self.spec.timeouts
        bound = float(t.download_seconds + t.restore_seconds + t.rebuild_seconds + t.resume_seconds)
        opened = await self.open_coordinator_session(action, bound, self.session_id(self.state.run))
        if opened is not None:
            opened.abort_listeners.append(lambda reason: self.fail_current("SessionAborted", reason))
            self.emit(SessionOpened(action.attempt))

    def address_moves(self, pods: Iterable[PodRef]) -> list[AddressMove]:
        """Each hostNetwork pod's node address then and now (its destination's agent serves on it)."""
        assert self.session is not None
        moves = []
        for pod in pods:
            recorded = self.recorded(pod.name)
            spec = recorded.template.spec if recorded.template else {}
            agent = self.session.nodes.get(pod.node)
            if spec.get("hostNetwork") and recorded.host_ip and agent is not None:
                moves.append(AddressMove(pod.name, recorded.host_ip, agent.host))
        return moves

    async def memory_sources(self, checkpoint: Checkpoint) -> list[MemoryCopySource]:
        """The checkpoint's memory copies that a ready agent lists as held now (drivers/memorycopies.py):
        the restoring agents read those chunks there, and the rest from S3."""
        held, agents = await memorycopies.held_now(self.rt, checkpoint)
        return [
            MemoryCopySource(node=c.node, address=agent_address(agents[c.node]), part=c.part) for c in held
        ]

    async def start_agents(self, action: DownloadImages) -> None:
        assert self.session is not None and self.state is not None
        checkpoint = await self.require_checkpoint()
        assert checkpoint.spec.job_name and checkpoint.spec.checkpoint_id  # resolve refused one without
        # committed in memory and not yet (or never) in S3: every part from a holder, or no restore at all
        memory_only = not memorytier.checkpoint_on_s3(checkpoint)
        resolved = await storage.check(
            self.rt.kube,
            self.namespace,
            checkpoint.spec.storage_ref,
            checkpoint.spec.storage,
            reach=not memory_only,
        )
        await secretgrants.grant(self.rt.kube, self.namespace, resolved.location)
        secret = resolved.location.credentials_secret_ref
        t = self.spec.timeouts
        # New for every restore and one for all nodes: the shim's rebuild records are per epoch, and an
        # image may hold the epoch of an earlier rebuild (a LeaveRunning checkpoint's is 1).
        epoch = max(2, int(time.time()))
        try:
            remap = address_map(self.address_moves(action.pods))
        except AddressConflict as conflict:
            self.emit(StepFailed(action.attempt, "AddressConflict", str(conflict)))
            return
        copies = await self.memory_sources(checkpoint)
        if memory_only and (lost := sorted(set(checkpoint.spec.nodes or []) - {c.part for c in copies})):
            message = (
                f"checkpoint {checkpoint.spec.checkpoint_id} is held in memory only (its S3 upload was not "
                f"merged) and no ready holder keeps the part of {', '.join(lost)}"
            )
            self.emit(StepFailed(action.attempt, "MemoryCopyLost", message))
            return
        requests: list[tuple[str, Agent, RestoreRequest]] = []
        for node, agent in sorted(self.session.nodes.items()):
            ranks = []
            for pod in action.pods:
                if pod.node != node:
                    continue
                for key in self.recorded(pod.name).ranks or ():
                    _, _, container, _ = rank_parts(key)
                    # No uid: the pod is created once the images are staged; the agent restores the
                    # pod of this namespace and name.
                    ranks.append(RestoreRank(pod_uid="", container=container, rank_key=key,
                                             namespace=self.namespace, pod=pod.name))  # fmt: skip
            request = RestoreRequest(
                session_id=self.session.id,
                coordinator=self.rt.coordinator_address(),
                session_token=self.session.tokens[node],  # type: ignore[arg-type]
                epoch=epoch,
                timeouts=PhaseTimeouts(
                    download_seconds=t.download_seconds,
                    restore_seconds=t.restore_seconds,
                    rebuild_seconds=t.rebuild_seconds,
                    resume_seconds=t.resume_seconds,
                ),
                job=rank_parts(ranks[0].rank_key)[0],
                images=ImageSource(
                    location=resolved.location,
                    credentials=SecretRef(namespace=self.namespace, name=secret.name),
                    job=checkpoint.spec.job_name,
                    checkpoint_id=checkpoint.spec.checkpoint_id,
                ),
                checkpoint=self.checkpoint_ref,
                ranks=ranks,
                remap_ip=remap,
                device_map=self.spec.device_map or None,
                memory_copies=copies or None,
                memory_only=memory_only,
            )
            requests.append((node, agent, request))

        def still_wanted() -> bool:
            return self.state is not None and self.state.attempt == action.attempt

        # A target node's agent may be restoring another job (two drains through one node): wait for it.
        sent = await each_agent([
            start_when_free(functools.partial(self.rt.gateway.restore, agent, request), node, still_wanted,
                            self.agent_busy)
            for node, agent, request in requests
        ])  # fmt: skip
        for (node, _, _), outcome in zip(requests, sent, strict=True):
            if isinstance(outcome, AgentError):
                self.emit(StepFailed(action.attempt, *agent_failure(node, outcome)))
                return
        for node, agent in self.session.nodes.items():
            self.follow(node, agent, self.session.id)

    # -- the agents' reports

    def follow(self, node: str, agent: Agent, session_id: str) -> None:
        if node not in self.polled:
            self.polled.add(node)
            self.spawn(self.poll(node, agent, session_id))

    async def follow_again(self) -> None:
        """After a restart in Resuming: the agents' sessions may have ended meanwhile; read their reports."""
        assert self.state is not None
        await self.load_checkpoint()  # its rank keys name the pods of the ranks (absorb)
        agents = await agents_by_node(self.rt.kube)
        for node in sorted({m.pod.node for m in self.state.members}):
            agent = agents.get(node)
            if agent is None:
                self.fail_current("AgentUnreachable", f"no ibckpt agent on node {node} to report the restore")
                return
            self.follow(node, agent, self.session_id(self.state.run))

    async def poll(self, node: str, agent: Agent, session_id: str) -> None:
        end = await follow_session(
            self.rt.gateway, agent, session_id, self.absorb, "AgentRefused", self.fate(agent)
        )
        if end.reason:
            self.fail_current(end.reason, end.message)

    def pods_of_ranks(self) -> dict[str, str]:
        """Rank key -> member (pod name), from the Checkpoint's record: a rank's pod uid is reported
        only once the runtime has restored its pod, and the pods do not exist while the images stage."""
        assert self.state is not None
        members = {m.pod.name for m in self.state.members}
        recorded = (self.checkpoint.spec.pods or ()) if self.checkpoint is not None else ()
        return {key: pod.name for pod in recorded if pod.name in members for key in pod.ranks or ()}

    def absorb(self, report: SessionReport) -> None:
        assert self.state is not None
        by_key = self.pods_of_ranks()
        by_uid = {m.pod.uid: m.pod.name for m in self.state.members if m.pod.uid}
        self.progress.absorb(report, lambda rank: by_key.get(rank.rank_key) or by_uid.get(rank.pod_uid))
        if report.memory_copy is not None:
            self.memory_reads[report.node] = report.memory_copy
        self.note_staging(report)
        self.report_progress()

    def note_staging(self, report: SessionReport) -> None:
        """While the images download: once every node has said how long its download still needs, the
        longest of them to the machine, which creates the pods when it is short (ImagesNearlyStaged)."""
        state, session, staging = self.state, self.session, report.staging
        if state is None or state.step is None or state.step.kind != RestoreStep.DOWNLOAD:
            return
        if session is None or staging is None:
            return
        left = staging_seconds_left(staging.bytes_done, staging.bytes_planned, staging.seconds)
        if left is None:
            self.staging_left.pop(report.node, None)
            return
        self.staging_left[report.node] = left
        if set(session.nodes) <= set(self.staging_left):
            self.emit(ImagesNearlyStaged(state.step.attempt, max(self.staging_left.values())))

    def report_progress(self) -> None:
        """One PodStepDone per pod that has reached the step in flight's milestone (once per attempt).
        Progress seen meanwhile is kept (self.progress): a pod restored while the others were still being
        created counts for the awaited Restored as soon as that step is issued (its effect calls this)."""
        state = self.state
        if state is None or state.step is None or state.phase not in (RestorePhase.DOWNLOADING, *LIVE_PHASES):
            return
        label = STEP_LABEL[RestoreStep(state.step.kind)]
        for done in self.progress.steps_done(state.step.attempt, label, [m.pod.name for m in state.members]):
            self.emit(done)

    def fail_current(self, reason: str, message: str) -> None:
        state = self.state
        if state is not None and state.attempt and state.phase not in (RestorePhase.CLEANING_UP, *TERMINAL):
            self.emit(StepFailed(state.attempt, reason, message))

    # -- undo

    async def clean_up(self, action: CleanUpRestore) -> None:
        """Abort the agents' sessions (each unstages its images), then delete every pod this restore
        created: by uid when status has it, else by name if the pod carries this run's marker."""
        assert self.state is not None
        run = self.state.run
        session_id = self.session.id if self.session else self.session_id(run)
        if session_id in self.rt.coordinator.sessions:
            self.rt.coordinator.sessions[session_id].abort(
                f"operator: {self.state.reason or 'restore failed'}"
            )
        agents = await agents_by_node(self.rt.kube)
        reason = (self.state.message or "the restore failed")[:1000]
        nodes = [node for node in sorted({pod.node for pod in action.pods}) if node in agents]
        aborted = await each_agent(
            [self.rt.gateway.abort(agents[node], session_id, reason) for node in nodes]
        )
        for node, outcome in zip(nodes, aborted, strict=True):
            if isinstance(outcome, AgentError):  # the pods go anyway: deleting them kills what was restored
                log.warning("%s: could not abort session %s on %s: %s", self.key, session_id, node, outcome)
        await self.delete_created(action)


__all__ = ["RestoreJobDriver", "RestorePhase"]
