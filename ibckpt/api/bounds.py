"""The default bound of every phase, in seconds: one table for the CRDs' timeouts, the agent API and the
node. A phase that outlives its bound aborts (before the commit) or fails (after it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseBounds:
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
