"""CheckpointSchedule: the policy object of one protected workload. Periodic CheckpointJobs with retention
(fixed interval, or Young/Daly from the measured cost and a given MTBF), and drain protection: migrate the
workload when a node it runs on is drained. docs/schedules.md and docs/drains.md explain both."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field, model_validator

from ibckpt.api.base import ApiModel, KindInfo, PrinterColumn
from ibckpt.api.checkpoint import PodTemplate
from ibckpt.api.checkpointjob import CheckpointJobSpec
from ibckpt.api.common import Conditions, ObservedGeneration
from ibckpt.api.storage import Retention

# A Checkpoint with this label set to "true" is never pruned by a schedule.
PIN_LABEL = "ibckpt.io/pinned"
# Every object a schedule makes carries it; its CheckpointJobs copy it onto their Checkpoints, which is how
# retention and a RestoreJob's latestOf find the schedule's Checkpoints.
SCHEDULE_LABEL = "ibckpt.io/schedule"


class OverlapPolicy(StrEnum):
    """What a fire does while the schedule's previous CheckpointJob still runs: Skip it, or Queue one run
    (at most one) that starts as soon as the running one ends."""

    SKIP = "Skip"
    QUEUE = "Queue"


class OnDrainFailure(StrEnum):
    """What a drain does when the migration misses its deadline or its checkpoint fails.
    ProceedAndLose: let the drain evict the pods; the running state since the last checkpoint is lost.
    KeepHolding: keep answering evictions with 429, retry the checkpoint, and warn until someone acts."""

    PROCEED_AND_LOSE = "ProceedAndLose"
    KEEP_HOLDING = "KeepHolding"


class DrainProtection(ApiModel):
    """Migrate the workload (checkpoint with Stop, commit, let the drain go on, restore elsewhere) when a
    node running one of its pods is drained or one of its pods is evicted."""

    enabled: bool = True
    deadline_seconds: int = Field(
        default=1800, ge=60, description="Bound on the migration, from the first hold to the commit."
    )
    on_failure: OnDrainFailure = OnDrainFailure.KEEP_HOLDING
    retry_seconds: int = Field(
        default=120, ge=10, description="KeepHolding: seconds between checkpoint retries and warnings."
    )
    restore: bool = Field(
        default=True, description="Restore the job on the remaining nodes once the drain proceeded."
    )


class NoCheckpointPolicy(StrEnum):
    """What a recovery does when no Checkpoint of the schedule can be restored (none yet, or the restore
    failed). WaitForPerson: touch nothing more, say so loudly. RestartFromScratch: stop every pod and let
    the workload's controller start them again from the beginning (bare pods have none: then it waits)."""

    WAIT_FOR_PERSON = "WaitForPerson"
    RESTART_FROM_SCRATCH = "RestartFromScratch"


class FencingPolicy(StrEnum):
    """When a pod on an unreachable node counts as not running, so that its rank may run elsewhere.
    NodeGone: its Node object is deleted, or its kubelet reported the pod ended. OutOfServiceTaint: also
    when the node carries node.kubernetes.io/out-of-service (non-graceful node shutdown). docs/recovery.md."""

    NODE_GONE = "NodeGone"
    OUT_OF_SERVICE_TAINT = "OutOfServiceTaint"


class RecoveryProtection(ApiModel):
    """Restore the whole workload from its latest restorable Checkpoint when a node running one of its
    pods stays NotReady longer than nodeNotReadySeconds, or one of its pods fails (docs/recovery.md)."""

    enabled: bool = True
    node_not_ready_seconds: int = Field(
        default=60, ge=0, description="A member's node NotReady or Unknown this long triggers a recovery."
    )
    pod_failure: bool = Field(
        default=True, description="A member pod Failed, or a container exited non-zero, triggers one."
    )
    no_checkpoint: NoCheckpointPolicy = NoCheckpointPolicy.WAIT_FOR_PERSON
    fencing: FencingPolicy = FencingPolicy.NODE_GONE
    deadline_seconds: int = Field(
        default=1800, ge=30, description="Bound on a recovery, from the detection to the restored job."
    )
    max_recoveries: int = Field(
        default=3,
        ge=1,
        description="At most this many recoveries start within windowSeconds; a failure beyond them waits "
        "for a person (TooManyRecoveries) and nothing is touched.",
    )
    window_seconds: int = Field(
        default=3600, ge=60, description="The sliding window maxRecoveries is counted in."
    )


class CheckpointScheduleSpec(ApiModel):
    """One of intervalSeconds (fixed) and mtbfSeconds (Young/Daly) makes it periodic; drain alone makes it
    a drain protection without periodic checkpoints. At least one of the three."""

    interval_seconds: int | None = Field(
        default=None, ge=60, description="Fixed seconds between the starts of two CheckpointJobs."
    )
    mtbf_seconds: int | None = Field(
        default=None,
        ge=60,
        description="Mean time between failures: the interval is sqrt(2 * cost * MTBF) (Young/Daly).",
    )
    min_interval_seconds: int = Field(default=300, ge=60, description="Lower clamp of the computed interval.")
    max_interval_seconds: int = Field(
        default=86400, ge=60, description="Upper clamp of the computed interval."
    )
    cost_window: int = Field(
        default=5, ge=1, le=100, description="The cost is the mean duration of this many last checkpoints."
    )
    overlap_policy: OverlapPolicy = OverlapPolicy.SKIP
    suspend: bool = Field(default=False, description="No periodic checkpoints (drain protection stays).")
    retention: Retention = Retention(keep_last=3)
    successful_jobs_history_limit: int = Field(
        default=3, ge=0, description="Finished CheckpointJobs that succeeded kept (their Checkpoints stay)."
    )
    failed_jobs_history_limit: int = Field(
        default=1, ge=0, description="Failed CheckpointJobs kept, for their status and Events."
    )
    drain: DrainProtection | None = Field(default=None, description="Migrate the workload on node drains.")
    recovery: RecoveryProtection | None = Field(
        default=None, description="Restore the workload from its latest checkpoint when it fails."
    )
    template: CheckpointJobSpec = Field(description="The spec of each CheckpointJob it creates.")

    @model_validator(mode="after")
    def _something_to_do(self) -> CheckpointScheduleSpec:
        if self.interval_seconds is not None and self.mtbf_seconds is not None:
            raise ValueError("give at most one of intervalSeconds and mtbfSeconds")
        protection = self.drain is not None or self.recovery is not None
        if self.interval_seconds is None and self.mtbf_seconds is None and not protection:
            raise ValueError("give intervalSeconds, mtbfSeconds, drain or recovery")
        if self.min_interval_seconds > self.max_interval_seconds:
            raise ValueError("minIntervalSeconds must not exceed maxIntervalSeconds")
        return self

    @property
    def periodic(self) -> bool:
        return not self.suspend and (self.interval_seconds is not None or self.mtbf_seconds is not None)


class MigrationSource(ApiModel):
    """A member pod when a drain's hold began, pinned by UID: exactly these may be evicted after the
    release."""

    name: str
    uid: str | None = None
    node: str | None = None
    controller_uid: str | None = Field(
        default=None,
        description="Its controller's uid when that controller names its pods anew (a Job): no new pod "
        "of it is admitted until the restore is over.",
    )


class MigrationStatus(ApiModel):
    """The drain machine's bookkeeping (operator/ibckpt_operator/machine/drain.py DrainState), kept so a
    restarted operator carries on the migration it was in."""

    seq: int = Field(default=0, ge=0, description="Migrations started.")
    tries: int = Field(default=0, ge=0, description="Checkpoint attempts of the current migration.")
    sources: list[MigrationSource] | None = None
    held_since: datetime | None = None
    deadline: datetime | None = None
    next_retry: datetime | None = None
    checkpoint_job: str | None = None
    cancelled_job: str | None = None
    checkpoint: str | None = None
    restore_job: str | None = None


class ScratchPod(ApiModel):
    """A member with no controller, as it was when its recovery began: nothing but the operator starts
    it again from scratch, from this template."""

    name: str
    uid: str | None = None
    template: PodTemplate


class RecoveryStatus(ApiModel):
    """The recovery machine's bookkeeping (operator/ibckpt_operator/machine/recovery.py RecoveryState)."""

    seq: int = Field(default=0, ge=0, description="Recoveries started.")
    trigger: str | None = Field(default=None, description="NodeNotReady, NodeGone or PodFailed.")
    nodes: list[str] | None = Field(default=None, description="The failed nodes the restore avoids.")
    sources: list[MigrationSource] | None = None
    from_scratch: bool | None = None
    restartable: bool | None = Field(
        default=None,
        description="Every source can start again from scratch: by its controller, or by the operator "
        "from its template in scratchPods.",
    )
    scratch_pods: list[ScratchPod] | None = Field(
        default=None,
        description="The sources with no controller, kept under noCheckpoint RestartFromScratch: the "
        "operator creates them again from these.",
    )
    failed_at: datetime | None = Field(default=None, description="When the failure began, as observed.")
    detected_at: datetime | None = None
    deadline: datetime | None = None
    ended_at: datetime | None = None
    restore_job: str | None = None
    checkpoint: str | None = Field(default=None, description="The Checkpoint restored.")
    checkpoint_time: datetime | None = None
    work_lost_seconds: float | None = Field(
        default=None, description="The failure's time minus the checkpoint's: the work done again."
    )
    recent_starts: list[datetime] | None = Field(
        default=None,
        description="When the recoveries that stopped the job began, within windowSeconds: what "
        "maxRecoveries counts.",
    )


class CheckpointScheduleStatus(ApiModel):
    last_checkpoint_time: datetime | None = None
    last_checkpoint_job: str | None = None
    active_job: str | None = Field(
        default=None, description="The CheckpointJob of this schedule now running."
    )
    next_checkpoint_time: datetime | None = None
    interval_seconds: float | None = Field(default=None, ge=0, description="The interval now in use.")
    cost_seconds: float | None = Field(default=None, ge=0, description="The measured cost it came from.")
    interval_source: str | None = Field(
        default=None, description="How the interval was chosen: Fixed, YoungDaly, Unmeasured (min clamp)."
    )
    last_fire_time: datetime | None = Field(
        default=None, description="The last fire (started, skipped or queued): the next is one interval on."
    )
    seq: int | None = Field(default=None, ge=0, description="Fires so far: the next job is <name>-<seq+1>.")
    queued: bool | None = Field(default=None, description="A fire waits for the running job (Queue).")
    active_since: datetime | None = None
    recent_costs: list[float] | None = Field(
        default=None, description="The measured seconds of the last costWindow successful checkpoints."
    )
    kept_count: int | None = Field(default=None, ge=0, description="Checkpoints kept by the last prune.")
    pruned_count: int | None = Field(default=None, ge=0, description="Checkpoints pruned so far.")
    last_prune_time: datetime | None = None
    drain_phase: str | None = Field(default=None, description="Where a drain migration is (Idle: none).")
    drain_reason: str | None = None
    drain_message: str | None = None
    drain_nodes: list[str] | None = Field(default=None, description="The drained nodes being moved off.")
    protected_by: str | None = Field(
        default=None,
        description="The PodDisruptionBudget kept over the workload's pods (policy/VERSION/NAME).",
    )
    migration: MigrationStatus | None = None
    recovery_phase: str | None = Field(default=None, description="Where a recovery is (Idle: none).")
    recovery_reason: str | None = None
    recovery_message: str | None = None
    recovery: RecoveryStatus | None = None
    message: str | None = None
    observed_generation: ObservedGeneration = None
    conditions: Conditions = None


CHECKPOINT_SCHEDULE = KindInfo(
    kind="CheckpointSchedule",
    plural="checkpointschedules",
    short_names=("ckps",),
    scope="Namespaced",
    summary="Periodic CheckpointJobs with retention, migration on node drains, recovery on failures.",
    spec=CheckpointScheduleSpec,
    status=CheckpointScheduleStatus,
    printer_columns=(
        PrinterColumn("Every", ".spec.intervalSeconds", "integer"),
        PrinterColumn("Suspend", ".spec.suspend", "boolean"),
        PrinterColumn("Last", ".status.lastCheckpointTime", "date"),
        PrinterColumn("Drain", ".status.drainPhase"),
        PrinterColumn("Recovery", ".status.recoveryPhase"),
        PrinterColumn("Interval", ".status.intervalSeconds", "number", priority=1),
    ),
)
