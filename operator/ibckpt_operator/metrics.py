"""Prometheus metrics: operations, phase durations, bytes, failures by reason, leadership."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

OPERATIONS = Counter(
    "ibckpt_operations_total", "CheckpointJobs and RestoreJobs that ended, by result", ["kind", "result"]
)
FAILURES = Counter("ibckpt_failures_total", "Jobs that failed, by reason", ["kind", "reason"])
PHASE_SECONDS = Histogram(
    "ibckpt_phase_duration_seconds",
    "Time spent in each phase",
    ["kind", "phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
CHECKPOINT_BYTES = Counter("ibckpt_checkpoint_bytes_total", "Image bytes of committed checkpoints")
ACTIVE = Gauge("ibckpt_jobs_active", "Jobs this operator is driving", ["kind"])
LEADER = Gauge("ibckpt_operator_leader", "1 while this replica holds the operator Lease")
CHECKPOINTS_DELETED = Counter(
    "ibckpt_checkpoints_deleted_total", "Checkpoint objects whose stored images were removed"
)

_started: set[tuple[str, int]] = set()
_lock = threading.Lock()


def serve(host: str, port: int) -> None:
    """Serve /metrics once per process and address (an in-process restart must not bind twice)."""
    if port <= 0:
        return
    with _lock:
        if (host, port) in _started:
            return
        start_http_server(port, addr=host)
        _started.add((host, port))


def ended(kind: str, phase: str, reason: str | None) -> None:
    OPERATIONS.labels(kind, phase).inc()
    if phase == "Failed":
        FAILURES.labels(kind, reason or "Unknown").inc()


# CheckpointSchedules (docs/schedules.md) and drain migrations (docs/drains.md), by schedule
# (<namespace>/<name>).
SCHEDULE_INTERVAL = Gauge(
    "ibckpt_schedule_interval_seconds", "The interval a schedule uses now (fixed or Young/Daly)", ["schedule"]
)
SCHEDULE_COST = Gauge(
    "ibckpt_schedule_cost_seconds", "The measured checkpoint cost the interval came from", ["schedule"]
)
SCHEDULE_SKIPPED = Counter(
    "ibckpt_schedule_skipped_total", "Fires skipped because the previous job still ran", ["schedule"]
)
SCHEDULE_PRUNED = Counter("ibckpt_schedule_pruned_total", "Checkpoints deleted by retention", ["schedule"])
STORAGE_PRUNED = Counter(
    "ibckpt_storage_pruned_total", "Checkpoints deleted by a CheckpointStorage's retention", ["storage"]
)
DRAIN_HELD = Gauge("ibckpt_drain_held", "1 while a drain of a protected workload is held", ["schedule"])
DRAIN_HOLD_SECONDS = Histogram(
    "ibckpt_drain_hold_seconds",
    "From the first hold to the end of a migration",
    ["schedule", "outcome"],
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
)
DRAIN_MIGRATIONS = Counter(
    "ibckpt_drain_migrations_total", "Drain migrations that ended, by outcome", ["schedule", "outcome"]
)


def record_schedule(schedule: str, interval: float | None, cost: float | None) -> None:
    if interval is not None:
        SCHEDULE_INTERVAL.labels(schedule).set(interval)
    if cost is not None:
        SCHEDULE_COST.labels(schedule).set(cost)


def record_migration(schedule: str, outcome: str, seconds: float) -> None:
    """outcome: Migrated, Lost, Failed, Cancelled."""
    DRAIN_MIGRATIONS.labels(schedule, outcome).inc()
    DRAIN_HOLD_SECONDS.labels(schedule, outcome).observe(max(0.0, seconds))


RECOVERING = Gauge("ibckpt_recovering", "1 while a protected workload is being recovered", ["schedule"])
RECOVERY_SECONDS = Histogram(
    "ibckpt_recovery_seconds",
    "From the detection of a failure to the end of its recovery",
    ["schedule", "outcome"],
    buckets=(5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
)
RECOVERIES = Counter("ibckpt_recoveries_total", "Recoveries that ended, by outcome", ["schedule", "outcome"])
RECOVERY_WORK_LOST = Gauge(
    "ibckpt_recovery_work_lost_seconds",
    "The last recovery's failure time minus its checkpoint's",
    ["schedule"],
)


def record_recovery(schedule: str, outcome: str, seconds: float, work_lost: float | None) -> None:
    """outcome: Recovered, RestartedFromScratch, WaitingForPerson, Failed."""
    RECOVERIES.labels(schedule, outcome).inc()
    RECOVERY_SECONDS.labels(schedule, outcome).observe(max(0.0, seconds))
    if work_lost is not None:
        RECOVERY_WORK_LOST.labels(schedule).set(work_lost)
