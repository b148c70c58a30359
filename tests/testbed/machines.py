"""A fake-clock driver for the pure job machines (CheckpointMachine, RestoreMachine): it feeds one machine
events, keeps its state, and records every action and phase. Each test file's subclass says how to answer
the step in flight on the happy path (`advance`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Generic, Protocol, TypeVar

from ibckpt_operator.machine.actions import AwaitMilestone
from ibckpt_operator.machine.core import Action, Event, PodRef, PodStepDone, RunState, StepAction, Transition

S = TypeVar("S", bound=RunState[Any])
A = TypeVar("A", bound=Action)
T0 = 1_800_000_000.0  # the fake clock's start
PODS = (PodRef("ring-0", "uid-0", "node-1"), PodRef("ring-1", "uid-1", "node-2"))  # a two-rank job


class Machine(Protocol[S]):
    def start(self, run: str, now: float) -> Transition[S]: ...

    def handle(self, state: S, event: Event, now: float) -> Transition[S]: ...


class MachineDriver(Generic[S]):
    """Feeds one job's machine, keeps its state, and records every action it asked for."""

    def __init__(self, machine: Machine[S], run: str, terminal: Collection[str]) -> None:
        self.machine = machine
        self.terminal = terminal
        self.now = T0
        self.actions: list[Action] = []
        self.phases: list[Any] = []
        first = machine.start(run, self.now)
        self.state: S = first.state
        self.last: Transition[S] = first
        self._record(first)

    def _record(self, transition: Transition[S]) -> None:
        # The attempt of every side effect is the one the new state records (written before acting).
        for action in transition.actions:
            if isinstance(action, StepAction):
                assert action.attempt == transition.state.attempt, (action, transition.state.step)
        self.actions.extend(transition.actions)
        if not self.phases or self.phases[-1] != transition.state.phase:
            self.phases.append(transition.state.phase)

    def send(self, event: Event, after: float = 0.0) -> Transition[S]:
        self.now += after
        transition = self.machine.handle(self.state, event, self.now)
        self.state = transition.state
        self.last = transition
        self._record(transition)
        return transition

    @property
    def attempt(self) -> str:
        assert self.state.attempt is not None
        return self.state.attempt

    def of_type(self, kind: type[A]) -> list[A]:
        return [action for action in self.actions if isinstance(action, kind)]

    def side_effects(self) -> list[str]:
        """The side effects asked for, in order, by name; a milestone awaited says which."""
        return [
            f"{type(a).__name__}({a.milestone})" if isinstance(a, AwaitMilestone) else type(a).__name__
            for a in self.actions
            if isinstance(a, StepAction)
        ]

    def each_done(self, key: str, size: int, seconds: float, after: float = 0.0) -> None:
        """Every live member finishes the step in flight; `key` names a member ("uid" or "name")."""
        for pod in self.state.live_pods:
            self.send(PodStepDone(self.attempt, getattr(pod, key), bytes=size, seconds=seconds), after=after)

    def advance(self) -> None:
        raise NotImplementedError

    def to_phase(self, phase: str) -> None:
        """Drive the happy path until `phase` is reached."""
        for _ in range(50):  # a machine that loops fails here instead of hanging
            if self.state.phase == phase:
                return
            assert self.state.phase not in self.terminal, self.phases
            self.advance()
        raise AssertionError(f"never reached {phase}: {self.phases}")
