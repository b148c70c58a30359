"""What a rank has finished: one vocabulary for the node's coordinator barriers, the agent's reports,
the operator's drivers and the per-pod labels in status.

A milestone is past tense (the rank has *done* it). The node names each coordinator barrier by the
milestone every rank of the node reached; the agent reports the last one a rank passed; the operator's
machine waits for each in turn and writes it as the pod's label.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Milestone(StrEnum):
    JOINED = "Joined"  # the node is connected to the job's coordinator
    ADMITTED = "Admitted"  # preflight found nothing that would stop the checkpoint
    QUIESCED = "Quiesced"
    DRAINED = "Drained"
    RELEASED = "Released"
    DUMPED = "Dumped"
    UPLOADED = "Uploaded"
    DOWNLOADED = "Downloaded"
    RESTORED = "Restored"
    REBUILT = "Rebuilt"
    RESUMED = "Resumed"


# The order a checkpoint goes in. A LeaveRunning node rebuilds and resumes its ranks before it uploads,
# so the operator takes Uploaded from the finished session, not from this order's position.
CHECKPOINT_MILESTONES: Final = (
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
