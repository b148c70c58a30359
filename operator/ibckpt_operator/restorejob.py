"""One RestoreJob's driver: resolves the Checkpoint, checks its storage, places each pod on a node with a
ready agent within the spec's constraints, admits the destinations and opens the coordinator session.

Not yet: creating the destination pods and handing the agents their restore (RestoreRequest needs each
rank's new pod UID). The job fails clearly at that step (reason RestoreNotImplemented), having touched
nothing, rather than wait.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable

from ibckpt.api import Checkpoint, RestoreJobSpec, RestoreJobStatus, RestorePhase
from ibckpt.store import StoreError
from ibckpt_operator import storage
from ibckpt_operator.agents import agents_by_node, no_agent_message
from ibckpt_operator.driver import Driver
from ibckpt_operator.kube import Body
from ibckpt_operator.machine import PodRef, RestoreConfig, RestoreMachine, RestoreState
from ibckpt_operator.machine.core import (
    Action,
    EmitEvent,
    Event,
    OperatorRestarted,
    PodAdmitted,
    PodRefused,
    PodStepDone,
    SessionOpened,
    StepAction,
    StepFailed,
    Transition,
)
from ibckpt_operator.machine.restore import (
    TERMINAL,
    AdmitNodes,
    CheckpointResolved,
    CleanUpRestore,
    CloseRestoreSession,
    DiscardStaged,
    OpenRestoreSession,
    PlacePods,
    PodsPlaced,
    ResolveCheckpoint,
)
from ibckpt_operator.machine.status import restore_state, restore_status
from ibckpt_operator.runtime import Runtime

log = logging.getLogger(__name__)
PLURAL = "restorejobs"
KIND = "RestoreJob"


def _node_ready(node: Body) -> bool:
    conditions = node.get("status", {}).get("conditions") or ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not node.get("spec", {}).get("unschedulable")


def _key(pod: PodRef) -> str:
    """The machine's key of a member (machine.core.Member.key)."""
    return pod.uid or pod.name


class RestoreJobDriver(Driver[RestoreState]):
    kind = KIND
    plural = PLURAL

    def __init__(self, runtime: Runtime, body: Body) -> None:
        super().__init__(runtime, body)
        self.spec = RestoreJobSpec.from_wire(body.get("spec") or {})
        self.machine = RestoreMachine(RestoreConfig.from_spec(self.spec))
        self.session_id: str | None = None

    def begin(self, now: float) -> Transition[RestoreState]:
        status = self.body.get("status") or {}
        if status.get("attempt"):
            parsed = RestoreJobStatus.from_wire(status)
            self.conditions = parsed.conditions
            self.state = restore_state(parsed)
            return self.machine.handle(self.state, OperatorRestarted(), now)
        return self.machine.start(secrets.token_hex(4), now)

    def terminal(self, state: RestoreState) -> bool:
        return state.phase in TERMINAL

    def handle(self, state: RestoreState, event: Event, now: float) -> Transition[RestoreState]:
        return self.machine.handle(state, event, now)

    def status_of(self, state: RestoreState, now: float) -> RestoreJobStatus:
        return restore_status(state, generation=self.generation, previous=self.conditions, now=now)

    def background(self) -> list[Awaitable[None]]:
        return []

    async def execute(self, action: Action) -> None:
        if isinstance(action, EmitEvent):
            await self.rt.kube.post_event(self.body, action.type, action.reason, action.message)
        elif isinstance(action, CloseRestoreSession):
            if self.session_id is not None:
                self.rt.coordinator.close_session(self.session_id)
        elif isinstance(action, DiscardStaged):
            pass  # nothing was downloaded by this operator
        elif isinstance(action, OpenRestoreSession):
            await self.open_session(action)
        elif isinstance(action, StepAction):
            self.spawn(self.guarded(action))

    async def guarded(self, action: StepAction) -> None:
        try:
            if isinstance(action, ResolveCheckpoint):
                await self.resolve(action)
            elif isinstance(action, PlacePods):
                await self.place(action)
            elif isinstance(action, AdmitNodes):
                await self.admit(action)
            elif isinstance(action, CleanUpRestore):
                for pod in action.pods:  # no rank was started by this operator
                    self.emit(PodStepDone(action.attempt, _key(pod)))
            else:
                message = (
                    "this operator cannot yet create the destination pods and start the agents' restore; "
                    "nothing was touched"
                )
                self.emit(StepFailed(action.attempt, "RestoreNotImplemented", message))
        except storage.StorageProblem as problem:
            self.emit(StepFailed(action.attempt, problem.reason, problem.message))
        except StoreError as error:
            self.emit(StepFailed(action.attempt, "StoreError", str(error)))
        except Exception as error:
            log.exception("%s: %s failed", self.key, type(action).__name__)
            self.emit(StepFailed(action.attempt, "OperatorError", f"{type(action).__name__}: {error}"))

    async def resolve(self, action: ResolveCheckpoint) -> None:
        body = await self.rt.kube.get_custom("checkpoints", self.namespace, action.checkpoint_name)
        if body is None:
            message = f"Checkpoint {self.namespace}/{action.checkpoint_name} does not exist"
            self.emit(StepFailed(action.attempt, "CheckpointNotFound", message))
            return
        checkpoint = Checkpoint.from_wire(body)
        await storage.check(
            self.rt.kube, self.namespace, checkpoint.spec.storage_ref, checkpoint.spec.storage
        )
        pods = tuple(PodRef(p.name, p.uid or "", p.node or "") for p in checkpoint.spec.pods or ())
        self.emit(CheckpointResolved(action.attempt, pods))

    async def place(self, action: PlacePods) -> None:
        agents = await agents_by_node(self.rt.kube)
        wanted = dict(action.node_selector)
        candidates = []
        for node in await self.rt.kube.list_nodes():
            name = node["metadata"]["name"]
            labels = node["metadata"].get("labels") or {}
            if name in action.avoid_nodes or not _node_ready(node):
                continue
            if any(labels.get(key) != value for key, value in wanted.items()):
                continue
            if name in agents and agents[name].ready:
                candidates.append(name)
        load = dict.fromkeys(candidates, 0)
        placed: dict[str, str] = {}
        for pod in action.pods:
            allowed = [n for n in candidates if not (self.spec.avoid_source_nodes and n == pod.node)]
            if not allowed:
                message = f"no Ready node with a ready ibckpt agent can take pod {pod.name}"
                self.emit(StepFailed(action.attempt, "NoNodeAvailable", message))
                return
            # The source node if allowed (images and addresses stay local), else the least loaded.
            chosen = pod.node if pod.node in allowed else min(allowed, key=lambda n: (load[n], n))
            placed[pod.name] = chosen
            load[chosen] += 1
        self.emit(PodsPlaced(action.attempt, placed))

    async def admit(self, action: AdmitNodes) -> None:
        agents = await agents_by_node(self.rt.kube)
        for pod in action.pods:
            agent = agents.get(pod.node)
            if agent is None or not agent.ready:
                self.emit(PodRefused(action.attempt, _key(pod), no_agent_message(pod.name, pod.node, agent)))
            else:
                self.emit(PodAdmitted(action.attempt, _key(pod)))

    async def open_session(self, action: OpenRestoreSession) -> None:
        assert self.state is not None
        nodes = {pod.node for pod in action.pods}
        t = self.spec.timeouts
        deadline = float(t.download_seconds + t.restore_seconds + t.rebuild_seconds + t.resume_seconds)
        self.session_id, _ = self.rt.coordinator.create_session(nodes, deadline, f"rsj-{self.state.run}")
        self.emit(SessionOpened(action.attempt))


__all__ = ["PLURAL", "RestoreJobDriver", "RestorePhase"]
