"""The words every component shares, defined once and with no dependency (the node's `ibckpt-node`
imports this without pydantic): what a rank has finished, the agent's mode, and each phase's bound.

Milestones: one vocabulary for the node's coordinator barriers, the agent's reports, the operator's
drivers and the per-pod labels in status.

A milestone is past tense (the rank has *done* it). The node names each coordinator barrier by the
milestone every rank of the node reached; the agent reports the last one a rank passed; the operator's
machine waits for each in turn and writes it as the pod's label.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class Milestone(StrEnum):
    JOINED = "Joined"  # the node is connected to the job's coordinator
    ADMITTED = "Admitted"  # preflight found nothing that would stop the checkpoint
    PRE_DUMPED = "PreDumped"  # the ranks' memory copied while they ran (only with spec.preDump)
    QUIESCED = "Quiesced"
    DRAINED = "Drained"
    RELEASED = "Released"
    DUMPED = "Dumped"
    UPLOADED = "Uploaded"
    MEMORY_KEPT = "MemoryKept"  # the part and its signed manifest sealed on its buddy (commitOn: Memory)
    DOWNLOADED = "Downloaded"
    RESTORED = "Restored"
    REBUILT = "Rebuilt"
    RESUMED = "Resumed"


# Not a milestone: a key of a node's session phases (SessionReport.phases), the seconds its ranks were
# gated by a LeaveRunning checkpoint, from the first quiesce until the last answered its resume.
GATED: Final = "gated"

# The order a checkpoint goes in. A LeaveRunning node rebuilds and resumes its ranks before it uploads,
# so the operator takes Uploaded from the finished session, not from this order's position.
CHECKPOINT_MILESTONES: Final = (
    Milestone.PRE_DUMPED,
    Milestone.QUIESCED,
    Milestone.DRAINED,
    Milestone.RELEASED,
    Milestone.DUMPED,
    Milestone.UPLOADED,
    Milestone.REBUILT,
    Milestone.RESUMED,
)
RESTORE_MILESTONES: Final = (
    Milestone.DOWNLOADED,
    Milestone.RESTORED,
    Milestone.REBUILT,
    Milestone.RESUMED,
)


def position(order: tuple[Milestone, ...], milestone: Milestone | str | None) -> int:
    """Where milestone stands in order; -1 for none or one the order does not have."""
    return order.index(Milestone(milestone)) if milestone in order else -1


class Mode(StrEnum):
    """What a node does after the dump. LeaveRunning: rebuild and resume. Stop: the ranks end (migration).
    Hold: the ranks stay alive but released (the staying side of a mixed restart)."""

    LEAVE_RUNNING = "LeaveRunning"
    STOP = "Stop"
    HOLD = "Hold"


@dataclass(frozen=True)
class PhaseBounds:
    """The default bound of every phase, in seconds: the CRDs' timeouts, the agent API and the node take
    theirs from DEFAULT_BOUNDS. A phase that outlives its bound aborts (before the commit) or fails."""

    admit: int = 60  # pods found, claimed and admitted
    preflight: int = 60  # a node checks its ranks before any is touched
    quiesce: int = 30
    drain: int = 60
    release: int = 60
    dump: int = 600
    upload: int = 1800  # including the manifest's commit
    publish: int = 60  # the Checkpoint object is created
    download: int = 1800
    restore: int = 600
    rebuild: int = 120
    resume: int = 30
    stop: int = 60  # the source processes are killed
    abort: int = 120  # every rank confirms it resumed
    cleanup: int = 120  # a failed restore's ranks are removed


DEFAULT_BOUNDS = PhaseBounds()


@dataclass(frozen=True)
class PhaseSeconds:
    """One session's bound on each of a node's phases: the agent API's PhaseTimeouts as the node reads it
    (`PhaseTimeouts.seconds()`), or DEFAULT_BOUNDS."""

    preflight_seconds: float = DEFAULT_BOUNDS.preflight
    quiesce_seconds: float = DEFAULT_BOUNDS.quiesce
    drain_seconds: float = DEFAULT_BOUNDS.drain
    release_seconds: float = DEFAULT_BOUNDS.release
    dump_seconds: float = DEFAULT_BOUNDS.dump
    upload_seconds: float = DEFAULT_BOUNDS.upload
    download_seconds: float = DEFAULT_BOUNDS.download
    restore_seconds: float = DEFAULT_BOUNDS.restore
    rebuild_seconds: float = DEFAULT_BOUNDS.rebuild
    resume_seconds: float = DEFAULT_BOUNDS.resume
