"""The loop every job driver shares: feed the machine, write its state to status BEFORE running the
actions that state records, run them, wait for the next observation or the machine's wake_at."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from ibckpt.api import ApiModel, Condition
from ibckpt.store import CheckpointExistsError, StoreError
from ibckpt_operator import metrics
from ibckpt_operator.cluster import storage
from ibckpt_operator.cluster.agents import Agent, agent_fate_now, agents_by_node
from ibckpt_operator.cluster.kube import Body, is_status
from ibckpt_operator.config import current
from ibckpt_operator.coordinator.session import Session as CoordinatorSession
from ibckpt_operator.drivers.progress import Session
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine.actions import CloseSession, OpenSession
from ibckpt_operator.machine.core import (
    Action,
    Cancelled,
    EmitEvent,
    Event,
    PodLost,
    PodRef,
    StepAction,
    StepFailed,
    Tick,
    Transition,
)

log = logging.getLogger(__name__)
S = TypeVar("S")
StopWaiter = Callable[[], Awaitable[str | None]]
WATCH_SECONDS = 2.0  # how often a job's pods are read again (no watch: a job holds only a few)


def status_body(status: ApiModel) -> Body:
    """A merge patch for the whole status: fields the state no longer has are removed (null)."""
    body = status.to_wire()
    for name, info in type(status).model_fields.items():
        body.setdefault(info.alias or name, None)
    return body


class UnreadableStatus(Exception):
    """A job's status has an attempt but cannot be read back into a state (not written by a driver)."""


class StepProblem(Exception):
    """A step cannot go on for a reason the user can act on: `reason` is one CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def step_failure(action: StepAction, error: Exception) -> StepFailed:
    """A step's exception as the machine's StepFailed: its own reason (StepProblem, the storage's), the
    store's, or OperatorError naming the step (never silently swallowed)."""
    if isinstance(error, (StepProblem, storage.StorageProblem)):
        return StepFailed(action.attempt, error.reason, error.message)
    if isinstance(error, CheckpointExistsError):
        return StepFailed(action.attempt, "CheckpointExists", str(error))
    if isinstance(error, StoreError):
        return StepFailed(action.attempt, "StoreError", str(error))
    return StepFailed(action.attempt, "OperatorError", f"{type(action).__name__}: {error}")


class Driver(Generic[S]):
    kind = ""
    plural = ""

    def __init__(self, runtime: Runtime, body: Body) -> None:
        self.rt = runtime
        self.body = body
        meta = body["metadata"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.key = f"{self.namespace}/{self.name}"
        self.generation: int | None = meta.get("generation")
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.tasks: set[asyncio.Task[None]] = set()
        self.conditions: list[Condition] | None = None
        self.state: S | None = None
        self.session: Session | None = None  # the job's coordinator session, once open

    # -- what each kind says

    def begin(self, now: float) -> Transition[S]:
        """The first transition: the machine's start, or OperatorRestarted on the state in status."""
        raise NotImplementedError

    def terminal(self, state: S) -> bool:
        raise NotImplementedError

    def handle(self, state: S, event: Event, now: float) -> Transition[S]:
        raise NotImplementedError

    def status_of(self, state: S, now: float) -> Any:
        raise NotImplementedError

    async def execute(self, action: Action) -> None:
        """The actions every kind runs alike: an event posted, the session closed, a step started as a
        task (its effect); a kind's own actions are its override's, which hands the rest here."""
        log.debug("%s: %s", self.key, type(action).__name__)
        if isinstance(action, EmitEvent):
            await self.rt.kube.post_event(self.body, action.type, action.reason, action.message)
        elif isinstance(action, CloseSession):
            if self.session is not None:
                self.rt.coordinator.close_session(self.session.id)
        elif isinstance(action, StepAction):
            self.spawn(self.guarded(action))
        else:
            log.warning("%s: no effect for %s", self.key, type(action).__name__)

    async def effect(self, action: StepAction) -> None:
        """A step's side effect; it answers by emitting events (run as a task by `guarded`)."""
        raise NotImplementedError

    async def agents_waited(self, agent_pods: list[str]) -> None:
        """Said once before a step waits for agents that are not Ready (cluster/agents.py)."""
        wait = current().agent_ready_wait_seconds
        pods = ", ".join(agent_pods)
        await self._waiting_for_agent(f"waiting up to {wait:.0f}s for ibckpt agent {pods} to be Ready")

    async def agent_busy(self, node: str, refusal: str) -> None:
        """Said once per node when a step waits for an agent that runs another session (cluster/agents.py)."""
        wait = current().agent_busy_wait_seconds
        await self._waiting_for_agent(
            f"node {node}: {refusal}; waiting up to {wait:.0f}s for it (one session per node at a time)"
        )

    async def _waiting_for_agent(self, message: str) -> None:
        log.info("%s: %s", self.key, message)
        await self.rt.kube.post_event(self.body, "Normal", "WaitingForAgent", message)

    def read_back(self, model: type[ApiModel], to_state: Callable[[Any], S]) -> S | None:
        """The state a driver wrote to this job's status (with its conditions), or None for a job no
        driver has started (no attempt yet)."""
        status = self.body.get("status") or {}
        if not status.get("attempt"):
            return None
        try:
            parsed = model.from_wire(status)
            state = to_state(parsed)
        except ValueError as error:
            raise UnreadableStatus(f"its status cannot be read back: {error}") from error
        self.conditions = getattr(parsed, "conditions", None)
        self.state = state
        return state

    async def open_coordinator_session(
        self, action: OpenSession, bound: float, session_id: str
    ) -> CoordinatorSession | None:
        """A coordinator session (self.session) for the nodes of the action's pods, each with a ready agent;
        None (the step failed: NoAgent) if one has none."""
        agents = await agents_by_node(self.rt.kube)
        nodes = {pod.node: agents[pod.node] for pod in action.pods if pod.node in agents}
        missing = sorted({pod.node for pod in action.pods} - set(nodes))
        if missing:
            self.emit(StepFailed(action.attempt, "NoAgent", f"no ready ibckpt agent on {', '.join(missing)}"))
            return None
        sid, tokens = self.rt.coordinator.create_session(set(nodes), bound, session_id)
        self.session = Session(sid, tokens, nodes)
        return self.rt.coordinator.sessions[sid]

    def fate(self, agent: Agent) -> Callable[[float], Awaitable[str]]:
        """For follow_session: what the agent pods say when `agent` is lost (an OOM kill, a replaced pod)."""
        return lambda since: agent_fate_now(self.rt.kube, agent, since)

    def phase_of(self, state: S) -> str:
        return str(getattr(state, "phase", ""))

    def background(self) -> list[Awaitable[None]]:
        return []

    # -- the loop

    async def run(self, stop: StopWaiter) -> None:
        """Drive the job until it ends, or until `stop` says "exit" (operator leaving: the state is in
        status) or "deleted" (the job is cancelled, the machine brings the ranks back first)."""
        transition = self.begin(time.time())
        metrics.ACTIVE.labels(self.kind).inc()
        cancelled = False
        for work in self.background():
            self.spawn(work)
        try:
            await self.apply(transition)
            while self.state is not None and not self.terminal(self.state):
                event, why = await self.next_event(transition.wake_at, stop, cancelled)
                if why == "exit":
                    return
                if why == "deleted":
                    cancelled = True
                    event = Cancelled()
                assert event is not None
                transition = self.handle(self.state, event, time.time())
                await self.apply(transition)
        finally:
            metrics.ACTIVE.labels(self.kind).dec()
            for task in list(self.tasks):
                task.cancel()

    async def next_event(
        self, wake_at: float | None, stop: StopWaiter, cancelled: bool
    ) -> tuple[Event | None, str | None]:
        if not self.events.empty():
            return self.events.get_nowait(), None
        timeout = current().tick_seconds
        if wake_at is not None:
            timeout = min(timeout, max(0.0, wake_at - time.time()) + 0.05)
        getter = asyncio.ensure_future(self.events.get())
        waiters: set[asyncio.Future[Any]] = {getter}
        stopper: asyncio.Future[str | None] | None = None
        if not cancelled:
            stopper = asyncio.ensure_future(stop())
            waiters.add(stopper)
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.cancel()
        if getter in done:
            return getter.result(), None
        if stopper is not None and stopper in done and stopper.result():
            return None, stopper.result()
        return Tick(), None

    async def apply(self, transition: Transition[S]) -> None:
        before = self.state
        self.state = transition.state
        now = time.time()
        if before is None or before != self.state:
            await self.write_status(now)
        if before is not None and self.phase_of(before) != self.phase_of(self.state):
            since = float(getattr(before, "phase_since", now))
            metrics.PHASE_SECONDS.labels(self.kind, self.phase_of(before)).observe(max(0.0, now - since))
            if self.terminal(self.state):
                metrics.ended(self.kind, self.phase_of(self.state), getattr(self.state, "reason", None))
        for action in transition.actions:
            await self.execute(action)

    async def write_status(self, now: float) -> None:
        assert self.state is not None
        status = self.status_of(self.state, now)
        self.conditions = status.conditions
        try:
            await self.rt.kube.patch_status(self.plural, self.namespace, self.name, status_body(status))
        except Exception as error:
            if is_status(error, 404):
                log.info("%s is gone; its status was not written", self.key)
                return
            raise

    async def guarded(self, action: StepAction) -> None:
        """A step's effect; any error fails the step with a reason (step_failure)."""
        try:
            await self.effect(action)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if not isinstance(error, (StepProblem, storage.StorageProblem, StoreError)):
                log.exception("%s: %s failed", self.key, type(action).__name__)
            self.emit(step_failure(action, error))

    def emit(self, event: Event) -> None:
        self.events.put_nowait(event)

    def spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def watch_pods(
        self,
        watched: Callable[[S], Iterable[tuple[str, PodRef]]],
        lost: Callable[[Body | None, PodRef], str | None],
    ) -> None:
        """Until the job ends, read the pods `watched` names (member key, pod) again and again; a pod
        `lost` finds a reason for is told to the machine once (PodLost under its member key)."""
        told: set[str] = set()
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            state = self.state
            if state is None or self.terminal(state):
                return
            for key, pod in watched(state):
                if key in told:
                    continue
                why = lost(await self.rt.kube.get_pod(self.namespace, pod.name), pod)
                if why is not None:
                    told.add(key)
                    self.emit(PodLost(key, why))
