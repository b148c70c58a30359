"""Which checkpoints a retention policy keeps. Pure: it sees summaries, the store does the deleting.

Rules apply to each job separately, newest checkpoint first. A checkpoint is kept when every rule that is set
keeps it:
- keep_last N: it is one of the job's N newest;
- max_age: it was committed no longer ago than this;
- max_bytes: the job's kept checkpoints, counting each shared chunk once, fit in this many stored bytes;
and, whatever the rules say, the job's `min_keep` newest checkpoints are kept (default 1: a restore always
has something to restore from, unless that is asked for explicitly with min_keep=0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ibckpt.store.layout import CheckpointRef


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    max_age: timedelta | None = None
    max_bytes: int | None = None
    min_keep: int = 1

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 0:
            raise ValueError("keep_last must be >= 0")
        if self.min_keep < 0:
            raise ValueError("min_keep must be >= 0")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")

    @property
    def empty(self) -> bool:
        return self.keep_last is None and self.max_age is None and self.max_bytes is None


@dataclass(frozen=True)
class CheckpointFacts:
    """What retention needs to know of one committed checkpoint."""

    ref: CheckpointRef
    created_at: datetime
    chunk_sizes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    ref: CheckpointRef
    keep: bool
    reason: str


def decide(checkpoints: Iterable[CheckpointFacts], policy: RetentionPolicy, now: datetime) -> list[Decision]:
    """One decision per checkpoint, grouped by job, newest first within a job."""
    by_job: dict[str, list[CheckpointFacts]] = {}
    for facts in checkpoints:
        by_job.setdefault(facts.ref.job, []).append(facts)
    decisions: list[Decision] = []
    for job in sorted(by_job):
        newest_first = sorted(
            by_job[job], key=lambda facts: (facts.created_at, facts.ref.checkpoint_id), reverse=True
        )
        kept_chunks: dict[str, int] = {}
        for position, facts in enumerate(newest_first):
            reason = _rule_that_drops(facts, position, policy, now, kept_chunks)
            if reason is not None and position < policy.min_keep:
                reason = None
                why_kept = f"one of the {policy.min_keep} newest (min_keep)"
            else:
                why_kept = "within every rule"
            if reason is None:
                kept_chunks.update(facts.chunk_sizes)
                decisions.append(Decision(facts.ref, True, why_kept))
            else:
                decisions.append(Decision(facts.ref, False, reason))
    return decisions


def _rule_that_drops(
    facts: CheckpointFacts,
    position: int,
    policy: RetentionPolicy,
    now: datetime,
    kept_chunks: Mapping[str, int],
) -> str | None:
    if policy.keep_last is not None and position >= policy.keep_last:
        return f"not among the {policy.keep_last} newest"
    if policy.max_age is not None and now - facts.created_at > policy.max_age:
        return f"older than {policy.max_age}"
    if policy.max_bytes is not None:
        total = sum(kept_chunks.values()) + sum(
            size for chunk, size in facts.chunk_sizes.items() if chunk not in kept_chunks
        )
        if total > policy.max_bytes:
            return f"the job's kept checkpoints would take {total} bytes, over {policy.max_bytes}"
    return None
