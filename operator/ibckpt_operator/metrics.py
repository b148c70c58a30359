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
