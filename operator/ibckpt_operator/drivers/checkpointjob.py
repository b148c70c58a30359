"""One CheckpointJob's driver: feeds the machine what happened, writes its state to status, then runs its
actions against Kubernetes, the agents, the coordinator and the store.

The machine decides everything. This only observes (pods, agent reports, coordinator barriers, the store)
and acts; every action runs after the state that records its attempt id is in status. The steps against
the store and the Checkpoint it publishes are the base class's, in checkpointstore.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable

from ibckpt.agentapi import (
    BUSY_STATUS,
    AgentError,
    AgentInfo,
    CheckpointRequest,
    ImageDestination,
    MemoryCopyTarget,
    Milestone,
    Mode,
    PhaseTimeouts,
    RankPhase,
    RankRef,
    SecretRef,
    SessionReport,
)
from ibckpt.api import CHECKPOINT, CheckpointJobStatus, CheckpointMode, JobPhase, StorageTier
from ibckpt.store.units import format_size
from ibckpt_operator.cluster import secretgrants, selection
from ibckpt_operator.cluster.agents import (
    Agent,
    agent_address,
    agent_failure,
    agents_by_node,
    agents_once_ready,
    each_agent,
    follow_session,
    no_agent_message,
    ready_agents,
)
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.cluster.pods import gone
from ibckpt_operator.config import current
from ibckpt_operator.drivers.base import StepProblem
from ibckpt_operator.drivers.checkpointstore import CheckpointStoreDriver
from ibckpt_operator.drivers.progress import Session
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import CheckpointMachine, JobConfig, JobState, PodRef, memorytier
from ibckpt_operator.machine.actions import (
    AdmitPods,
    ClaimPods,
    CommitInMemory,
    CommitManifest,
    DiscardUpload,
    KillSources,
    OpenSession,
    PublishCheckpoint,
    QuiesceRanks,
    ReleaseClaim,
    ResumeAll,
    SelectPods,
    VerifyManifest,
)
from ibckpt_operator.machine.checkpoint import (
    AFTER_COMMIT,
    AGENT_BUSY,
    STEP_LABEL,
    TERMINAL,
    MemoryCopyMissed,
)
from ibckpt_operator.machine.core import (
    Action,
    Event,
    OperatorRestarted,
    PodAdmitted,
    PodRefused,
    PodsBusy,
    PodsClaimed,
    PodsSelected,
    PodStepDone,
    SessionAborted,
    SessionOpened,
    StepAction,
    StepFailed,
    Transition,
)
from ibckpt_operator.machine.status import job_state, job_status
from ibckpt_operator.machine.timings import paused_seconds, upload_rate

log = logging.getLogger(__name__)

# An abort is sent to a node's agent again when that agent was replaced while it worked on it.
ABORT_TURNS = 3


class CheckpointJobDriver(CheckpointStoreDriver):
    def __init__(self, runtime: Runtime, body: Body) -> None:
        super().__init__(runtime, body)
        # commitOn Memory: the nodes whose part and its manifest are sealed on their buddy, and those whose
        # copy failed (why); (attempt, pod or node) already told to the machine
        self.kept_nodes: set[str] = set()
        self.missed_nodes: dict[str, str] = {}
        self.memory_told: set[tuple[str, str]] = set()

    @property
    def commits_in_memory(self) -> bool:
        return self.spec.commit_on == StorageTier.MEMORY

    # -- the machine

    def begin(self, now: float) -> Transition[JobState]:
        state = self.read_back(CheckpointJobStatus, job_state)
        run = secrets.token_hex(4) if state is None else state.run
        config = JobConfig.from_spec(self.spec, self.checkpoint_name(run), current().agent_busy_wait_seconds)
        self.machine = CheckpointMachine(config)
        if state is None:
            return self.machine.start(run, now)
        return self.machine.handle(state, OperatorRestarted(), now)

    def terminal(self, state: JobState) -> bool:
        return state.phase in TERMINAL

    def handle(self, state: JobState, event: Event, now: float) -> Transition[JobState]:
        assert self.machine is not None
        return self.machine.handle(state, event, now)

    def status_of(self, state: JobState, now: float) -> CheckpointJobStatus:
        status = job_status(
            state,
            checkpoint_name=self.machine_checkpoint_name(),
            generation=self.generation,
            previous=self.conditions,
            now=now,
        )
        return self.with_timings(status, state, now)

    def with_timings(self, status: CheckpointJobStatus, state: JobState, now: float) -> CheckpointJobStatus:
        """The nodes' measured phases, what each pod was paused, and each node's upload rate. A restarted
        operator has no reports of the nodes' finished sessions: what was written stays."""
        leave_running = self.spec.mode != CheckpointMode.STOP
        node_bytes: dict[str, int] = {}
        for row in status.pods or ():
            if row.node:
                node_bytes[row.node] = node_bytes.get(row.node, 0) + (row.bytes or 0)
        rows = [
            row.model_copy(
                update={
                    "frozen_seconds": paused_seconds(phases, leave_running),
                    "upload_bytes_per_second": upload_rate(node_bytes.get(row.node), phases),
                }
            )
            if row.node and (phases := self.node_phases.get(row.node))
            else row
            for row in status.pods or ()
        ]
        total = round(state.finished_at - state.started_at, 3) if state.finished_at is not None else None
        timings = self.timings(state, now)
        if timings is not None:
            timings = timings.model_copy(update={"total_seconds": total})
        size = format_size(status.bytes) if status.bytes else None
        return status.model_copy(update={"pods": rows or status.pods, "timings": timings, "size": size})

    def background(self) -> list[Awaitable[None]]:
        # a member that is deleted or replaced (another uid) is lost: the machine aborts
        return [self.watch_pods(self.watched, lambda body, pod: gone(body, pod, f"pod {pod.name}"))]

    def watched(self, state: JobState) -> list[tuple[str, PodRef]]:
        if state.phase == JobPhase.PENDING:
            return []
        return [(m.pod.uid, m.pod) for m in state.members if m.progress != "Lost"]

    # -- actions

    async def execute(self, action: Action) -> None:
        if isinstance(action, ReleaseClaim):
            self.rt.claims.release(self.key)
        elif isinstance(action, ClaimPods):
            holder = self.rt.claims.claim(self.key, (pod.uid for pod in action.pods))
            self.emit(PodsClaimed(action.attempt) if holder is None else PodsBusy(action.attempt, holder))
        elif isinstance(action, OpenSession):
            await self.open_session(action)
        elif isinstance(action, DiscardUpload):
            # the job may end (Failed) before a store that is down lets the discard give up: it must
            # still get to say so
            self.rt.detach(self.discard(action), f"discard {self.key}")
        else:
            await super().execute(action)

    async def effect(self, action: StepAction) -> None:
        if isinstance(action, SelectPods):
            await self.select(action)
        elif isinstance(action, AdmitPods):
            await self.admit(action)
        elif isinstance(action, QuiesceRanks):
            await self.start_agents(action)
        elif isinstance(action, CommitManifest):
            await self.commit(action)
        elif isinstance(action, CommitInMemory):
            await self.commit_in_memory(action)
        elif isinstance(action, VerifyManifest):
            await self.verify(action)
        elif isinstance(action, PublishCheckpoint):
            await self.publish(action)
        elif isinstance(action, KillSources):
            await self.kill(action)
        elif isinstance(action, ResumeAll):
            await self.resume_all(action)
        else:  # AwaitMilestone (drain to resume): the agents go on by themselves
            self.report_progress()

    async def select(self, action: SelectPods) -> None:
        # The storage is checked first: bad credentials or an unreachable bucket fail before any pod.
        await self.store()
        if self.commits_in_memory:
            await self.require_memory_tier()
        name = self.spec.checkpoint_name
        if name and await self.rt.kube.get_custom(CHECKPOINT.plural, self.namespace, name) is not None:
            # a commit would refuse it anyway (the store never replaces a manifest): say so before any
            # rank is touched
            message = (
                f"Checkpoint {self.namespace}/{name} already exists: give the job another checkpointName"
            )
            raise StepProblem("CheckpointExists", message)
        pods = await selection.select_pods(
            self.rt.kube, self.namespace, self.spec.selector, self.spec.workload_ref
        )
        self.emit(PodsSelected(action.attempt, pods))

    async def require_memory_tier(self) -> None:
        """commitOn Memory needs the tier on and a ring of two ready agents (each part on another node):
        refused before any pod is touched, rather than committed on S3 unasked."""
        if not current().memory_tier:
            message = "commitOn: Memory needs the memory tier (the chart's agent.memoryTier.bytes above 0)"
            raise StepProblem("MemoryTierUnavailable", message)
        ready = sorted(await ready_agents(self.rt.kube))
        if len(ready) < 2:
            message = (
                f"commitOn: Memory needs two nodes with a ready ibckpt agent (each part is kept on another "
                f"node), found {len(ready)}: {', '.join(ready) or 'none'}"
            )
            raise StepProblem("MemoryTierUnavailable", message)

    async def admit(self, action: AdmitPods) -> None:
        scheduled: list[tuple[PodRef, Body, str]] = []
        for pod in action.pods:
            body = await self.rt.kube.get_pod(self.namespace, pod.name)
            uid = (body or {}).get("metadata", {}).get("uid")
            if body is None or uid != pod.uid:
                self.emit(PodRefused(action.attempt, pod.uid, f"pod {pod.name} is gone or was replaced"))
                continue
            node = body.get("spec", {}).get("nodeName") or ""
            if not node:
                self.emit(PodRefused(action.attempt, pod.uid, f"pod {pod.name} is not scheduled to a node"))
                continue
            scheduled.append((pod, body, node))
        agents = await agents_once_ready(self.rt.kube, {node for _, _, node in scheduled}, self.agents_waited)
        placed: list[tuple[PodRef, Body, str]] = []  # pods on a node with a ready agent
        for pod, body, node in scheduled:
            agent = agents.get(node)
            if agent is None or not agent.ready:
                self.emit(PodRefused(action.attempt, pod.uid, no_agent_message(pod.name, node, agent)))
                continue
            placed.append((pod, body, node))
        # every node's agent asked at once, then each pod judged in order as before
        nodes = list(dict.fromkeys(node for _, _, node in placed))
        infos = dict(
            zip(nodes, await each_agent([self.rt.gateway.info(agents[n]) for n in nodes]), strict=True)
        )
        registered: dict[str, set[str]] = {}
        for node, info in infos.items():
            if isinstance(info, AgentInfo):
                registered[node] = {c.pod_uid for c in info.containers if c.shim} if info.ready else set()
                self.record.agent_versions[node] = info.version
                self.record.saw_agent(node, info)
        for pod, body, node in placed:
            error = infos[node]
            if isinstance(error, AgentError):
                message = f"pod {pod.name} is on node {node} whose ibckpt agent does not answer: {error}"
                self.emit(PodRefused(action.attempt, pod.uid, message))
                continue
            if pod.uid not in registered[node]:
                message = (
                    f"pod {pod.name} has no container registered with the ibckpt agent on node {node} "
                    "(does it run with the ibckpt runtime class and get an RDMA device?)"
                )
                self.emit(PodRefused(action.attempt, pod.uid, message))
                continue
            self.record.saw(body)
            self.emit(PodAdmitted(action.attempt, pod.uid))

    async def open_session(self, action: OpenSession) -> None:
        assert self.state is not None
        t = self.spec.timeouts
        bound = float(
            t.quiesce_seconds + t.drain_seconds + t.release_seconds + t.dump_seconds + t.upload_seconds
            + t.publish_seconds + t.rebuild_seconds + t.resume_seconds + t.abort_seconds
            + (t.dump_seconds if self.spec.pre_dump else 0)
        )  # fmt: skip
        opened = await self.open_coordinator_session(action, bound, self.session_id(self.state))
        if opened is not None:
            opened.arrival_listeners.append(self.on_barrier)
            opened.abort_listeners.append(lambda reason: self.on_abort(reason, opened.refused))
            self.emit(SessionOpened(action.attempt))

    def pods_on(self, node: str) -> list[PodRef]:
        assert self.state is not None
        return [m.pod for m in self.state.members if m.pod.node == node]

    def on_barrier(self, barrier: str, node: str) -> None:
        if self.progress.passed_barrier(barrier, [pod.uid for pod in self.pods_on(node)]):
            self.report_progress()

    def on_abort(self, reason: str, refused: bool = False) -> None:
        """The coordinator session was aborted; a node's preflight refusal is named as the agents'
        reports would name it, whichever of the two arrives first."""
        assert self.state is not None
        if self.state.phase not in (JobPhase.ABORTING, *TERMINAL):
            # not tied to the step in flight: the machine may have moved on before it sees this
            self.emit(SessionAborted("PreflightRefused" if refused else "SessionAborted", reason))

    def report_progress(self) -> None:
        """One PodStepDone per pod that has reached the step in flight's milestone (once per attempt)."""
        state = self.state
        if state is None or state.step is None:
            return
        if state.phase == JobPhase.ABORTING:
            return
        label = STEP_LABEL.get(state.step.kind)  # type: ignore[call-overload]
        if self.commits_in_memory:
            self.report_memory_progress(state, label)
        for done in self.progress.steps_done(state.step.attempt, label, [m.pod.uid for m in state.members]):
            self.emit(done)

    async def start_agents(self, action: QuiesceRanks) -> None:
        assert self.session is not None and self.state is not None
        resolved = await self.store()
        await secretgrants.grant(self.rt.kube, self.namespace, resolved.location)
        secret = resolved.location.credentials_secret_ref
        t = self.spec.timeouts
        # Stop: the agents dump and hold the ranks released; the pods are deleted only after the commit.
        mode = Mode.HOLD if self.spec.mode == CheckpointMode.STOP else Mode.LEAVE_RUNNING
        first_rank = 0  # each node's container trees take the next numbers in the checkpoint
        nodes = list(self.session.nodes.items())
        infos = await each_agent([self.rt.gateway.info(agent) for _, agent in nodes])
        buddies = await self.memory_buddies()
        self.memory_holders = {node: target.node for node, target in buddies.items()}
        requests: list[tuple[str, Agent, CheckpointRequest]] = []
        for (node, agent), info in zip(nodes, infos, strict=True):
            if isinstance(info, AgentError):
                self.emit(StepFailed(action.attempt, "AgentUnreachable", f"node {node}: {info}"))
                return
            uids = {pod.uid for pod in self.pods_on(node)}
            ranks = [
                RankRef(pod_uid=c.pod_uid, container=c.container, pod=f"{c.namespace}/{c.pod}")
                for c in info.containers
                if c.shim and c.pod_uid in uids
            ]
            request = CheckpointRequest(
                session_id=self.session.id,
                coordinator=self.rt.coordinator_address(),
                session_token=self.session.tokens[node],  # type: ignore[arg-type]
                timeouts=PhaseTimeouts(
                    preflight_seconds=t.admit_seconds,
                    quiesce_seconds=t.quiesce_seconds,
                    drain_seconds=t.drain_seconds,
                    release_seconds=t.release_seconds,
                    dump_seconds=t.dump_seconds,
                    upload_seconds=t.upload_seconds,
                    rebuild_seconds=t.rebuild_seconds,
                    resume_seconds=t.resume_seconds,
                ),
                job=self.rank_job,
                mode=mode,
                ranks=ranks,
                pre_dump=self.spec.pre_dump,
                images=ImageDestination(
                    location=resolved.location,
                    credentials=SecretRef(namespace=self.namespace, name=secret.name),
                    job=self.store_job,
                    checkpoint_id=self.machine_checkpoint_name(),
                    first_rank=first_rank,
                    compression=None if self.spec.compression == "zstd" else self.spec.compression,
                ),
                job_addresses=sorted({a.host for a in self.session.nodes.values() if a.host}),
                memory_copy=buddies.get(node),
            )
            first_rank += len(ranks)
            requests.append((node, agent, request))
        # all nodes at once: at 128 agents one call after another would hold the cut back
        sent = await each_agent(
            [self.rt.gateway.checkpoint(agent, request) for _, agent, request in requests]
        )
        for (node, _, _), outcome in zip(requests, sent, strict=True):
            if isinstance(outcome, AgentError) and outcome.status == BUSY_STATUS:
                # the machine takes the session back and asks again: no rank is gated before every
                # node joined its preflight
                self.emit(StepFailed(action.attempt, AGENT_BUSY, f"node {node}: {outcome.message}"))
                return
            if isinstance(outcome, AgentError):
                self.emit(StepFailed(action.attempt, *agent_failure(node, outcome)))
                return
        for node, agent in self.session.nodes.items():
            self.spawn(self.poll(node, agent, action.attempt))

    async def memory_buddies(self) -> dict[str, MemoryCopyTarget]:
        """Where each of the job's nodes keeps its part in memory (machine/memorytier.py), when the release
        runs the memory tier; a node with no buddy (a one-node cluster) keeps S3 only."""
        assert self.session is not None
        if not current().memory_tier:
            return {}
        agents = await ready_agents(self.rt.kube)
        return {
            node: MemoryCopyTarget(
                node=buddy, address=agent_address(agents[buddy]), first=self.commits_in_memory
            )
            for node, buddy in memorytier.buddies(self.session.nodes, agents).items()
        }

    async def poll(self, node: str, agent: Agent, attempt: str) -> None:
        """Follow the node's session report until it ends: rank progress, bytes, and failures."""
        assert self.session is not None
        end = await follow_session(
            self.rt.gateway, agent, self.session.id, self.absorb, fate=self.fate(agent)
        )
        if end.reason and end.report is not None and self.commits_in_memory:
            self.absorb_copy(end.report)  # a failed session's last report may be the first with its copy
            if end.report.node in self.kept_nodes:
                # dumped and kept in memory: its upload's failure is the background commit's to report
                log.info("%s: node %s's upload after its copy: %s", self.key, node, end.message)
                self.absorb(end.report)
                return
        if end.reason:
            self.fail_current(end.reason, end.message)

    def fail_current(self, reason: str, message: str) -> None:
        state = self.state
        if state is not None and self.after_memory_commit(state):
            # the session ends with its S3 upload, which the background commit waits for (durable.py)
            log.info("%s: a node's upload after the memory commit: %s: %s", self.key, reason, message)
            return
        if state is not None and state.attempt and state.phase not in (JobPhase.ABORTING, *TERMINAL):
            self.emit(StepFailed(state.attempt, reason, message))

    def absorb(self, report: SessionReport) -> None:
        for rank in report.ranks:
            self.record.rank_keys.setdefault(rank.pod_uid, set()).add(rank.rank_key)
        # A succeeded session: staged, and (LeaveRunning) rebuilt and resumed; held (Stop) ranks wait for
        # the kill.
        self.progress.absorb(report, lambda rank: rank.pod_uid)
        if report.phases:
            self.node_phases[report.node] = dict(report.phases)
        if report.memory_copy is not None:
            self.memory_reports[report.node] = report.memory_copy
        if self.commits_in_memory:
            self.absorb_copy(report)
        self.report_progress()

    def absorb_copy(self, report: SessionReport) -> None:
        """commitOn Memory: a node's part is kept once its report has MemoryKept (with its copy); it is
        missed when its copy failed, or when its session ended without one."""
        copy = report.memory_copy
        if Milestone.MEMORY_KEPT in report.phases and copy is not None and copy.kept:
            self.kept_nodes.add(report.node)
        elif copy is not None and not copy.kept:
            self.missed_nodes[report.node] = copy.message or "its agent did not keep it"
        elif report.state.finished and report.node not in self.kept_nodes:
            self.missed_nodes[report.node] = f"its session ended {report.state} with no copy"

    def after_memory_commit(self, state: JobState) -> bool:
        return state.committed_on == StorageTier.MEMORY and state.phase in AFTER_COMMIT

    def report_memory_progress(self, state: JobState, label: object) -> None:
        """MemoryKept, and after a memory commit a LeaveRunning node's rebuild and resume, from the copies:
        its agent resumed the ranks before it kept the copy, and its session ends only with the upload."""
        assert state.step is not None
        attempt = state.step.attempt
        if label == Milestone.MEMORY_KEPT:
            if self.missed_nodes and (attempt, "missed") not in self.memory_told:
                self.memory_told.add((attempt, "missed"))
                node, why = sorted(self.missed_nodes.items())[0]
                self.emit(MemoryCopyMissed(attempt, node, why))
                return
        elif not (label in (Milestone.REBUILT, Milestone.RESUMED) and self.after_memory_commit(state)):
            return
        if label != Milestone.MEMORY_KEPT and self.spec.mode == CheckpointMode.STOP:
            return
        for member in state.members:
            if member.pod.node in self.kept_nodes and (attempt, member.pod.uid) not in self.memory_told:
                self.memory_told.add((attempt, member.pod.uid))
                self.emit(PodStepDone(attempt, member.pod.uid))

    async def kill(self, action: KillSources) -> None:
        for pod in action.pods:
            await self.rt.kube.delete_pod(self.namespace, pod.name, pod.uid)
            self.emit(PodStepDone(action.attempt, pod.uid))

    async def resume_all(self, action: ResumeAll) -> None:
        """The abort: every node's agent brings its ranks back; a node that never started is done."""
        assert self.state is not None
        session_id = self.session.id if self.session else self.session_id(self.state)
        agents = await agents_by_node(self.rt.kube)
        nodes = sorted({pod.node for pod in action.pods})
        # The abort names the coordinator to rebuild released ranks through: the session's own, or after
        # a restart (it went with the last operator) a new one. Ranks a Stop or Hold dump left released,
        # and those of an agent that died, are rebuilt through it by an agent whose driver is over.
        if self.session is None or session_id not in self.rt.coordinator.sessions:
            session = self.open_recovery(session_id, nodes, agents)
        else:
            self.rt.coordinator.sessions[session_id].abort(f"operator: {self.state.reason or 'aborted'}")
            session = self.session
        # each node is handed its own credential (another's is refused); a node not in the session none
        address, tokens = self.rt.coordinator_address(), session.tokens
        rejoin = {node: (address, tokens[node]) for node in nodes if node in tokens}
        await asyncio.gather(
            *(
                self.resume_node(node, agents.get(node), session_id, action, rejoin.get(node))
                for node in nodes
            )
        )

    def open_recovery(self, session_id: str, nodes: list[str], agents: dict[str, Agent]) -> Session:
        """After a restart the session's coordinator is gone with the last operator. Ranks it left
        released can only be rebuilt with their peers through one, so the abort names a new one,
        under the same session id, for the same nodes."""
        t = self.spec.timeouts
        bound = float(t.abort_seconds + t.rebuild_seconds + t.resume_seconds)
        sid, tokens = self.rt.coordinator.create_session(set(nodes), bound, session_id)
        self.session = Session(sid, tokens, {n: agents[n] for n in nodes if n in agents})
        log.info("%s: opened a coordinator for the recovery of session %s", self.key, sid)
        return self.session

    async def resume_node(
        self,
        node: str,
        agent: Agent | None,
        session_id: str,
        action: ResumeAll,
        rejoin: tuple[str, str] | None = None,
    ) -> None:
        pods = [pod for pod in action.pods if pod.node == node]

        def failed(reason: str, message: str) -> None:
            for pod in pods:
                self.emit(StepFailed(action.attempt, reason, message, pod=pod.uid))

        report: SessionReport | None = None
        for turn in range(ABORT_TURNS):
            agent = agent if agent is not None and agent.host else await self._next_agent(node)
            if agent is None:
                return failed("AgentUnreachable", f"no ibckpt agent on node {node} to resume it")
            try:
                report, agent = await self._send_abort(agent, session_id, rejoin)
            except AgentError as error:
                return failed("AgentUnreachable", f"node {node}: {error}")
            if report is None or report.state.finished:
                break
            end = await follow_session(
                self.rt.gateway, agent, session_id, lambda _: None, fate=self.fate(agent)
            )
            if end.report is not None:
                report = end.report
                break
            if end.reason != "AgentLostSession" or turn == ABORT_TURNS - 1:
                return failed(end.reason, end.message)
            # replaced while it brought the ranks back (a rollout): its successor holds the session's
            # record, and only an abort makes it rebuild the released ranks
            log.info("%s: node %s's agent was replaced mid-abort: asking its successor", self.key, node)
            agent = None
        broken = {r.pod_uid for r in (report.ranks if report else []) if r.phase == RankPhase.FAILED}
        for pod in pods:
            if pod.uid in broken:
                self.emit(
                    StepFailed(action.attempt, "ResumeFailed", f"node {node}: rank failed", pod=pod.uid)
                )
            else:
                self.emit(PodStepDone(action.attempt, pod.uid))

    async def _next_agent(self, node: str) -> Agent | None:
        """The node's agent, waited for as long as a silent one: a rollout (helm upgrade) leaves a node
        without an agent pod for a moment, and its released ranks come back only through the next."""
        asked = time.monotonic()
        while time.monotonic() - asked <= current().agent_unreachable_seconds:
            agent = await self._agent_with_address(node)
            if agent is not None:
                return agent
            await asyncio.sleep(current().poll_seconds)
        return None

    async def _agent_with_address(self, node: str) -> Agent | None:
        """The node's agent pod once it has an address: a pod just made by its DaemonSet has none yet."""
        agent = (await agents_by_node(self.rt.kube)).get(node)
        return agent if agent is not None and agent.host else None

    async def _send_abort(
        self, agent: Agent, session_id: str, rejoin: tuple[str, str] | None
    ) -> tuple[SessionReport | None, Agent]:
        """The abort, retried while the agent is silent or stopping (503): one that is restarting (it
        crashed, or a rollout replaces it) answers again soon, and brings back what its predecessor
        left. Each retry goes to the node's current agent pod (a replaced one has a new address). Raises
        AgentError once the node's agent has been silent for as long as a session's poll may be, or at
        once on another error it answered. Returns the report and the agent that answered."""
        reason = (self.state.message if self.state else None) or "aborted by the operator"
        asked = time.monotonic()
        while True:
            try:
                return await self.rt.gateway.abort(agent, session_id, reason[:1000], rejoin), agent
            except AgentError as error:
                answered = error.status not in (0, 503)
                if answered or time.monotonic() - asked > current().agent_unreachable_seconds:
                    raise
                await asyncio.sleep(current().poll_seconds)
                agent = await self._agent_with_address(agent.node) or agent
