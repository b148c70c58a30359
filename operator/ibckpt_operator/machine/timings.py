"""A checkpoint's timings from its nodes' session reports (`SessionReport.phases`: seconds per phase,
each ending at the barrier every node passes). Pure.

- A phase took what its slowest node took: every node waits at its barrier for that one.
- A pre-dump (spec.preDump) runs before the cut, while the ranks run: it is not part of the pause.
- The commit took from the cut (the job entering Quiescing) to the commit on the job's tier (entering
  Committed): with commitOn Memory, the copies; with S3, the upload. A schedule's cost.
- A node's ranks were gated (paused) from the cut (quiesce) until they ran again: through rebuild and
  resume for LeaveRunning; until the dump ended for Stop (the ranks then wait for the kill and run again
  only where they are restored). A LeaveRunning node says it itself (`gated`: until its last rank
  answered its resume, the Resumed barrier after that not counted); else the phases are summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ibckpt.api import CheckpointTimings, JobPhase
from ibckpt.vocabulary import GATED, Milestone
from ibckpt_operator.machine.core import PhaseSpan

CUT = (Milestone.QUIESCED, Milestone.DRAINED, Milestone.RELEASED, Milestone.DUMPED)
BACK = (Milestone.REBUILT, Milestone.RESUMED)
Phases = Mapping[str, float]


def paused_seconds(phases: Phases, leave_running: bool) -> float | None:
    """How long one node's ranks were gated; None before its cut began."""
    if leave_running and GATED in phases:
        return round(phases[GATED], 3)
    parts = [phases[m] for m in (*CUT, *BACK) if m in phases and (leave_running or m in CUT)]
    return round(sum(parts), 3) if parts else None


def _slowest(by_node: Mapping[str, Phases], milestone: Milestone) -> float | None:
    found = [phases[milestone] for phases in by_node.values() if milestone in phases]
    return round(max(found), 3) if found else None


def checkpoint_timings(
    by_node: Mapping[str, Phases], leave_running: bool, total_seconds: float | None
) -> CheckpointTimings | None:
    """The job's timings; None while no node reported a finished phase."""
    if not any(by_node.values()):
        return None
    paused = [p for phases in by_node.values() if (p := paused_seconds(phases, leave_running)) is not None]
    return CheckpointTimings(
        pause_seconds=max(paused) if paused else None,
        pre_dump_seconds=_slowest(by_node, Milestone.PRE_DUMPED),
        quiesce_seconds=_slowest(by_node, Milestone.QUIESCED),
        drain_seconds=_slowest(by_node, Milestone.DRAINED),
        release_seconds=_slowest(by_node, Milestone.RELEASED),
        dump_seconds=_slowest(by_node, Milestone.DUMPED),
        upload_seconds=_slowest(by_node, Milestone.UPLOADED),
        total_seconds=None if total_seconds is None else round(max(0.0, total_seconds), 3),
    )


def commit_seconds(spans: Iterable[PhaseSpan], phase: str, phase_since: float) -> float | None:
    """From the cut to the commit, from the job's phases (those it left, and the one it is in since
    `phase_since`); None before the commit. A session opened again starts its cut again: the last counts."""
    started = {span.phase: span.started_at for span in spans}
    committed = phase_since if phase == JobPhase.COMMITTED else started.get(JobPhase.COMMITTED)
    cut = started.get(JobPhase.QUIESCING)
    if committed is None or cut is None or committed < cut:
        return None
    return round(committed - cut, 3)


def upload_rate(bytes_: int | None, phases: Phases) -> int | None:
    """Bytes per second of a node's upload, once it finished."""
    seconds = phases.get(Milestone.UPLOADED)
    if not bytes_ or not seconds:
        return None
    return int(bytes_ / seconds)
