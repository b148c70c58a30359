"""A CheckpointStorage's retention: which of the Checkpoints written to it are deleted. Pure.

Rules apply to each job separately, newest first; a job is the schedule that made the checkpoint (its
`ibckpt.io/schedule` label), else the job's name in the store. Pinned checkpoints and those a RestoreJob
that has not ended names are always kept and count for no rule. Of the others, the job's `minKeep` newest
complete ones are kept whatever the rules say; any other one is deleted when a rule that is set drops it:
- `keepLast` N: it is not among the job's N newest complete checkpoints;
- `maxAgeSeconds`: it is older than this;
- `maxTotalBytes`: the job's kept checkpoints, newest first, with each shared chunk counted once, no
  longer fit in this many bytes (chunk sizes from the manifests; a checkpoint without them counts its
  own bytes).
An incomplete checkpoint (never ready to restore) goes by age only. A schedule's own retention applies too:
a checkpoint either drops is deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ibckpt.api.storage import Retention
from ibckpt_operator.machine.schedule import Decision


@dataclass(frozen=True)
class StoredCheckpoint:
    """What retention needs of one Checkpoint that names the storage."""

    name: str
    group: str  # "schedule NAME" or "job NS/NAME": rules count within it
    created_at: float
    complete: bool = True
    pinned: bool = False
    used_by: str | None = None  # a RestoreJob that has not ended
    bytes: int = 0
    chunk_sizes: Mapping[str, int] = field(default_factory=dict)  # digest -> stored size, when known


def decide(checkpoints: Iterable[StoredCheckpoint], rules: Retention, now: float) -> list[Decision]:
    """One decision per checkpoint: groups in name order, newest first within a group."""
    groups: dict[str, list[StoredCheckpoint]] = {}
    for checkpoint in checkpoints:
        groups.setdefault(checkpoint.group, []).append(checkpoint)
    decisions: list[Decision] = []
    for group in sorted(groups):
        newest_first = sorted(groups[group], key=lambda c: (c.created_at, c.name), reverse=True)
        decisions += _decide_group(newest_first, rules, now)
    return decisions


def _decide_group(newest_first: list[StoredCheckpoint], rules: Retention, now: float) -> list[Decision]:
    decisions: list[Decision] = []
    kept_chunks: dict[str, int] = {}
    position = 0
    for checkpoint in newest_first:
        age = now - checkpoint.created_at
        too_old = rules.max_age_seconds is not None and age > rules.max_age_seconds
        if checkpoint.pinned:
            decisions.append(Decision(checkpoint.name, True, "pinned"))
            continue
        if checkpoint.used_by is not None:
            decisions.append(Decision(checkpoint.name, True, f"in use by RestoreJob {checkpoint.used_by}"))
            continue
        if not checkpoint.complete:
            why = f"incomplete and older than {rules.max_age_seconds:g}s" if too_old else "incomplete"
            decisions.append(Decision(checkpoint.name, not too_old, why))
            continue
        mine, position = position, position + 1
        chunks = dict(checkpoint.chunk_sizes) or {f"checkpoint {checkpoint.name}": checkpoint.bytes}
        reason = _dropped_by(rules, mine, too_old, sum({**kept_chunks, **chunks}.values()))
        if reason is None:
            kept_chunks.update(chunks)
            newest = mine < rules.min_keep
            why = f"one of the {rules.min_keep} newest (minKeep)" if newest else "within every rule"
            decisions.append(Decision(checkpoint.name, True, why))
        else:
            decisions.append(Decision(checkpoint.name, False, reason))
    return decisions


def _dropped_by(rules: Retention, position: int, too_old: bool, total_bytes: int) -> str | None:
    """Why the complete checkpoint at `position` (0: the group's newest) goes; None: it stays."""
    if position < rules.min_keep:
        return None
    if rules.keep_last is not None and position >= rules.keep_last:
        return f"not among the {rules.keep_last} newest"
    if too_old:
        return f"older than {rules.max_age_seconds:g}s"
    if rules.max_total_bytes is not None and total_bytes > rules.max_total_bytes:
        return f"with the newer ones kept it would store {total_bytes} bytes, over {rules.max_total_bytes}"
    return None
