"""How far each pod of a job got, in its kind's milestone order (ibckpt.vocabulary), from the
agents' session reports and the coordinator's barriers; and which pods the machine has yet to be told
finished the step in flight (one PodStepDone per pod and attempt).

The order is passed in, not imported per kind, so the drivers that own a PodProgress stay its only users.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ibckpt.agentapi import Milestone, RankProgress, SessionReport, SessionState, position
from ibckpt_operator.cluster.agents import Agent
from ibckpt_operator.machine.core import PodStepDone


@dataclass
class Session:
    """A job's coordinator session, the agent of each node in it, and each node's credential (given to
    that node's agent alone: with another's, an agent would be refused)."""

    id: str
    tokens: dict[str, str]
    nodes: dict[str, Agent]


class PodProgress:
    """Per pod, the position in `order` of the last milestone all its ranks passed.

    `finished` is what every rank of a succeeded session has done. A rank's own milestones count only up
    to `until` (a LeaveRunning checkpoint rebuilds and resumes before it uploads, so past the dump only
    the finished session says the part is uploaded). `count_zero_bytes`: a report's zero is the pod's size
    so far (a checkpoint's bytes written), or says nothing (a restore's ranks report bytes once staged).
    """

    def __init__(
        self,
        order: tuple[Milestone, ...],
        finished: Milestone,
        until: Milestone | None = None,
        count_zero_bytes: bool = False,
    ) -> None:
        self.order = order
        self.finished = position(order, finished)
        self.until = position(order, until) if until is not None else len(order) - 1
        self.count_zero_bytes = count_zero_bytes
        self.reached: dict[str, int] = {}  # pod -> position of its last milestone
        self.bytes: dict[str, int] = {}
        self.reported: set[tuple[str, str]] = set()  # (attempt, pod) already told to the machine

    def at(self, milestone: Milestone | str | None) -> int:
        return min(position(self.order, milestone), self.until)

    def passed_barrier(self, barrier: str, pods: Iterable[str]) -> bool:
        """Every rank of a node's pods passed the barrier named by a milestone of this order; False (and
        nothing recorded) for any other barrier."""
        try:
            reached = self.at(Milestone(barrier))
        except ValueError:
            return False
        if reached < 0:
            return False
        for pod in pods:
            self.reached[pod] = max(self.reached.get(pod, -1), reached)
        return True

    def absorb(self, report: SessionReport, pod_of: Callable[[RankProgress], str | None]) -> None:
        """A node's session report: each pod is as far as its slowest rank (ranks of no pod are skipped)."""
        succeeded = report.state == SessionState.SUCCEEDED
        by_pod: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for rank in report.ranks:
            pod = pod_of(rank)
            if pod is None:
                continue
            by_pod.setdefault(pod, []).append(self.finished if succeeded else self.at(rank.done))
            sizes[pod] = sizes.get(pod, 0) + rank.bytes
        for pod, reached in by_pod.items():
            self.reached[pod] = max(self.reached.get(pod, -1), min(reached))
            if sizes[pod] or self.count_zero_bytes:
                self.bytes[pod] = sizes[pod]

    def steps_done(
        self, attempt: str, milestone: Milestone | str | None, pods: Iterable[str]
    ) -> list[PodStepDone]:
        """A PodStepDone for each pod that has reached `milestone` and was not yet told for this attempt."""
        wanted = position(self.order, milestone)
        if wanted < 0:
            return []
        done = []
        for pod in pods:
            if self.reached.get(pod, -1) >= wanted and (attempt, pod) not in self.reported:
                self.reported.add((attempt, pod))
                done.append(PodStepDone(attempt, pod, bytes=self.bytes.get(pod)))
        return done
