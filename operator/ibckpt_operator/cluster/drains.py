"""What the drain machine (machine/drain.py) needs from the cluster, and its state in status.

- Which nodes are being drained: a cordon (`spec.unschedulable`) or an autoscaler's drain taint. The Node
  watch (handlers/drain.py) keeps `DRAINING` up to date; every protected schedule reads it.
- The observations of one migration: its CheckpointJob's and RestoreJob's phases as machine events.
- DrainState <-> the schedule's status (drainPhase, drainReason, drainMessage, drainNodes, migration).
- Which new pods a migration under way refuses (the webhook's answer, through bindings.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from ibckpt.api import JobPhase, RestorePhase
from ibckpt.api.schedule import CheckpointScheduleStatus, MigrationSource, MigrationStatus
from ibckpt_operator.cluster import bindings
from ibckpt_operator.machine.core import Event, PodRef
from ibckpt_operator.machine.drain import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStarted,
    DrainPhase,
    DrainState,
    RestoreFailed,
    RestoreSucceeded,
    SourcesStopped,
)

# NoSchedule/NoExecute taints that the cluster autoscaler and Karpenter put on a node they are about to
# drain. (DeletionCandidateOfClusterAutoscaler is PreferNoSchedule, a soft hint: not a drain.)
DRAIN_TAINTS = frozenset(
    {"ToBeDeletedByClusterAutoscaler", "karpenter.sh/disrupted", "karpenter.sh/disruption"}
)

# Node name -> draining, as the Node watch last saw it.
DRAINING: dict[str, bool] = {}
# Node name -> when the Node watch last saw it start draining (a cordon and an uncordon between two passes
# of a controller are both seen).
DRAINED_AT: dict[str, float] = {}

# CheckpointJob phases in which the job has touched the ranks (admitted, session open).
TOUCHING = frozenset(
    {
        JobPhase.PRE_DUMPING,
        JobPhase.QUIESCING,
        JobPhase.DRAINING,
        JobPhase.RELEASING,
        JobPhase.DUMPING,
        JobPhase.UPLOADING,
    }
)
AFTER_COMMIT = frozenset({JobPhase.COMMITTED, JobPhase.STOPPED, JobPhase.SUCCEEDED})

# From the commit to the restore a source's name is reserved for its restored pod (bindings.py).
CLAIMING = frozenset({DrainPhase.COMMITTED, DrainPhase.RELEASING, DrainPhase.RESTORING})
# From the hold to the restore a renaming controller (a Job) of a source may create no pod: the commit
# deletes the sources, and its new pod would start from scratch beside the restored one it adopts.
REFUSING_CONTROLLERS = CLAIMING | {DrainPhase.HOLDING, DrainPhase.CHECKPOINTING}


def node_draining(node: Mapping[str, Any]) -> bool:
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return True
    return any(
        taint.get("key") in DRAIN_TAINTS and taint.get("effect") in ("NoSchedule", "NoExecute")
        for taint in spec.get("taints") or ()
    )


def draining_nodes() -> set[str]:
    return {node for node, draining in DRAINING.items() if draining}


def checkpoint_job_events(name: str, job: Mapping[str, Any] | None) -> list[Event]:
    """What a migration's CheckpointJob says now. Fed on every pass: the machine ignores what it already
    knows. A job that is gone after its commit has ended (its finalizer waits for the daemon)."""
    if job is None:
        return []
    status = job.get("status") or {}
    phase = status.get("phase")
    checkpoint = status.get("checkpointName") or name
    events: list[Event] = []
    committed = bool(status.get("manifestKey")) and phase != JobPhase.ABORTING
    if phase in TOUCHING or phase in AFTER_COMMIT or committed:
        events.append(CheckpointStarted(name))
    if phase in AFTER_COMMIT or (committed and phase != JobPhase.FAILED):
        events.append(CheckpointCommitted(name, checkpoint))
    if phase == JobPhase.SUCCEEDED:
        events.append(SourcesStopped(name))
    elif phase == JobPhase.FAILED and not status.get("manifestKey"):
        reason = str(status.get("reason") or "CheckpointFailed")
        events.append(CheckpointFailed(name, reason, str(status.get("message") or reason)))
    return events


def restore_job_events(name: str, job: Mapping[str, Any] | None) -> list[Event]:
    status = (job or {}).get("status") or {}
    if status.get("phase") == RestorePhase.SUCCEEDED:
        return [RestoreSucceeded(name)]
    if status.get("phase") == RestorePhase.FAILED:
        reason = status.get("reason") or "Failed"
        return [RestoreFailed(name, f"RestoreJob {name}: {reason}: {status.get('message') or ''}".rstrip())]
    return []


# -- status


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _seconds(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def migration_sources(pods: Iterable[PodRef], controllers: Mapping[str, str]) -> list[MigrationSource]:
    """The status rows of the pods a drain or a recovery moves; `controllers`: renaming controllers by uid."""
    return [
        MigrationSource(
            name=p.name, uid=p.uid or None, node=p.node or None, controller_uid=controllers.get(p.uid)
        )
        for p in pods
    ]


def drain_status(state: DrainState, controllers: dict[str, str] | None = None) -> dict[str, Any]:
    """The status fields of a DrainState (the caller merges them with the schedule's); `controllers`:
    the sources' renaming controllers by pod uid."""
    sources = migration_sources(state.sources, controllers or {})
    migration = MigrationStatus(
        seq=state.seq,
        tries=state.tries,
        sources=sources or None,
        held_since=_time(state.held_since),
        deadline=_time(state.deadline),
        next_retry=_time(state.next_retry),
        checkpoint_job=state.checkpoint_job,
        cancelled_job=state.cancelled_job,
        checkpoint=state.checkpoint,
        restore_job=state.restore_job,
    )
    return {
        "drain_phase": state.phase.value,
        "drain_reason": state.reason,
        "drain_message": state.message,
        "drain_nodes": list(state.nodes) or None,
        "migration": migration,
    }


def source_controllers(status: CheckpointScheduleStatus) -> dict[str, str]:
    """The sources' renaming controllers a previous operator wrote, by pod uid."""
    sources = (status.migration.sources if status.migration else None) or ()
    return {s.uid: s.controller_uid for s in sources if s.uid and s.controller_uid}


def drain_state(name: str, status: CheckpointScheduleStatus) -> DrainState | None:
    """The state a previous operator wrote, or None if it never protected this workload."""
    if status.drain_phase is None:
        return None
    migration = status.migration or MigrationStatus()
    return DrainState(
        name=name,
        phase=DrainPhase(status.drain_phase),
        seq=migration.seq,
        tries=migration.tries,
        nodes=tuple(status.drain_nodes or ()),
        sources=tuple(PodRef(s.name, s.uid or "", s.node or "") for s in migration.sources or ()),
        held_since=_seconds(migration.held_since),
        deadline=_seconds(migration.deadline),
        next_retry=_seconds(migration.next_retry),
        checkpoint_job=migration.checkpoint_job,
        cancelled_job=migration.cancelled_job,
        checkpoint=migration.checkpoint,
        restore_job=migration.restore_job,
        reason=status.drain_reason,
        message=status.drain_message,
    )


def refusal(
    drain: DrainState, pod: bindings.NewPod, namespace: str, schedule: str, controllers: dict[str, str]
) -> bindings.Waiting | None:
    """While a migration is between its commit and its restore, a new pod named as a source is
    refused: it is restored once its images are staged (the RestoreJob binds it then). From the
    hold to the restore, so is any new pod of a source's renaming controller (a Job): the RestoreJob
    creates the sources again under their names, and the controller adopts them."""
    if (
        pod.name
        and pod.namespace == namespace
        and drain.phase in CLAIMING
        and any(source.name == pod.name for source in drain.sources)
    ):
        return bindings.Waiting(
            f"ibckpt: pod {pod.name} is being migrated by CheckpointSchedule {schedule} ({drain.phase}) "
            f"and is restored from Checkpoint {drain.checkpoint} once its images are staged; its "
            "controller will create it again"
        )
    if (
        pod.controller_uid
        and drain.phase in REFUSING_CONTROLLERS
        and pod.controller_uid in {controllers.get(source.uid) for source in drain.sources}
    ):
        restored = f"Checkpoint {drain.checkpoint}" if drain.checkpoint else "the checkpoint being taken"
        return bindings.Waiting(
            f"ibckpt: the pods of this controller are being migrated by CheckpointSchedule {schedule} "
            f"({drain.phase}); they come back under their names, restored from {restored}, and the "
            "controller adopts them: it needs no new pod"
        )
    return None
