"""Which Checkpoint a RestoreJob restores: the checks every Checkpoint must pass before a restore touches
anything, and, for `latestOf`, the newest of a schedule's or a workload's Checkpoints that passes them,
with the reason each newer one was passed over. Pure: the driver lists the Checkpoints, this chooses."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ibckpt.api import Checkpoint, LatestCheckpoint, WorkloadReference
from ibckpt.api.schedule import SCHEDULE_LABEL
from ibckpt_operator.machine.restoreplan import rank_parts


@dataclass(frozen=True)
class Refusal:
    """Why a Checkpoint cannot be restored here: the reason (a status reason) and what to tell the user."""

    reason: str
    message: str


def refusal(checkpoint: Checkpoint, namespace: str) -> Refusal | None:
    """None if this operator can restore `checkpoint` into `namespace`, as far as its spec and status tell."""
    spec, name = checkpoint.spec, f"{namespace}/{checkpoint.metadata.name}"
    if spec.job_name and not spec.job_name.startswith(f"{namespace}/"):
        # The store's job names are namespace/name: anyone who may write a Checkpoint here could otherwise
        # point a restore at another namespace's images in a shared bucket.
        return Refusal(
            "ForeignCheckpoint",
            f"Checkpoint {name} names the images of job {spec.job_name}, which is not in namespace "
            f"{namespace}: a RestoreJob restores only its own namespace's images",
        )
    problems = (
        [] if spec.job_name and spec.checkpoint_id else ["it names no job or checkpoint id in the store"]
    )
    for pod in spec.pods or ():
        if pod.template is None:
            problems.append(f"it records no pod template for {pod.name}")
        if not pod.ranks:
            problems.append(f"it records no rank of {pod.name}")
        for key in pod.ranks or ():
            try:
                rank_parts(key)
            except ValueError as error:
                problems.append(f"{pod.name}: {error}")
    if problems:
        return Refusal(
            "CheckpointNotRestorable",
            f"Checkpoint {name} cannot be restored by this operator: {'; '.join(problems)} "
            "(taken by an operator that did not record them?)",
        )
    return None


@dataclass(frozen=True)
class Choice:
    """The Checkpoint chosen (None: none of the group can be restored) and the newer ones passed over."""

    name: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why), newest first
    considered: int = 0


def same_workload(source: WorkloadReference | None, wanted: WorkloadReference) -> bool:
    if source is None or (source.kind, source.name) != (wanted.kind, wanted.name):
        return False
    return wanted.api_version is None or source.api_version == wanted.api_version


def in_group(checkpoint: Checkpoint, latest: LatestCheckpoint) -> bool:
    if latest.schedule is not None:
        return (checkpoint.metadata.labels or {}).get(SCHEDULE_LABEL) == latest.schedule
    assert latest.workload is not None
    return same_workload(checkpoint.spec.source, latest.workload)


def taken_at(checkpoint: Checkpoint) -> float:
    """When it was committed (its creation, for a Checkpoint that does not say)."""
    when = checkpoint.spec.committed_time or checkpoint.metadata.creation_timestamp
    return when.timestamp() if when is not None else 0.0


def choose_latest(checkpoints: Iterable[Checkpoint], namespace: str, latest: LatestCheckpoint) -> Choice:
    """The newest Checkpoint of the group that is ready and passes `refusal`; ties go to the later name."""
    group = [c for c in checkpoints if in_group(c, latest)]
    group.sort(key=lambda c: (taken_at(c), c.metadata.name or ""), reverse=True)
    skipped: list[tuple[str, str]] = []
    for checkpoint in group:
        name = checkpoint.metadata.name or ""
        status = checkpoint.status
        if checkpoint.metadata.deletion_timestamp is not None:
            skipped.append((name, "it is being deleted"))
        elif status is not None and status.ready_to_restore is False:
            skipped.append((name, f"it is not ready to restore: {status.message or 'no reason given'}"))
        elif (refused := refusal(checkpoint, namespace)) is not None:
            skipped.append((name, f"{refused.reason}: {refused.message}"))
        else:
            return Choice(name, skipped, len(group))
    return Choice(None, skipped, len(group))


def describe(latest: LatestCheckpoint) -> str:
    if latest.schedule is not None:
        return f"schedule {latest.schedule}"
    assert latest.workload is not None
    return f"{latest.workload.kind} {latest.workload.name}"
