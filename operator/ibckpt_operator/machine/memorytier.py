"""The memory tier's decisions (docs/recovery.md, "Tiers"): which agent keeps each node's part of a
checkpoint in memory, what the Checkpoint says about it, and which copies a restore may read. Pure.

Placement: the nodes with a ready agent form a ring in name order; a node's part goes to the next node of
the ring, never to the node itself. Each agent then holds its predecessor's parts only, so the memory a
node gives the tier does not grow with the size of the cluster, and a single failed node leaves its part
on a living neighbour.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from ibckpt.agentapi.memory import HeldCopies
from ibckpt.agentapi.models import MemoryCopyReport
from ibckpt.api import Checkpoint, MemoryCopy, StorageTier


def buddies(job_nodes: Iterable[str], agent_nodes: Collection[str]) -> dict[str, str]:
    """Each job node's buddy: the next node after it in the ring of `agent_nodes` (the nodes whose agent is
    ready). A node alone in the ring has none; a job node outside it (its agent is not ready: the job
    does not get this far) is placed where it would sort."""
    ring = sorted(set(agent_nodes))
    chosen: dict[str, str] = {}
    for node in sorted(set(job_nodes)):
        after = [other for other in ring if other > node]
        buddy = after[0] if after else (ring[0] if ring else None)
        if buddy is not None and buddy != node:
            chosen[node] = buddy
    return chosen


def kept_copies(reports: Mapping[str, MemoryCopyReport]) -> list[MemoryCopy]:
    """The copies the job's agents sealed on their buddies (by source node), in node order."""
    return [
        MemoryCopy(part=part, node=report.node, chunks=report.chunks, bytes=report.bytes)
        for part, report in sorted(reports.items())
        if report.kept
    ]


def tiers(copies: Collection[MemoryCopy], parts: Collection[str], on_s3: bool = True) -> list[StorageTier]:
    """S3 when the manifest is there (always, but after a commit on the memory tier until the upload is
    merged: `on_s3`); Memory when every part of the checkpoint has a kept copy. Empty: held nowhere whole."""
    held = {copy.part for copy in copies}
    whole = bool(parts) and set(parts) <= held
    return [StorageTier.S3] * on_s3 + [StorageTier.MEMORY] * whole


def on_s3(tiers_now: Collection[StorageTier] | None) -> bool:
    """Whether a Checkpoint's manifest is in S3: unset tiers mean S3 only (before the memory tier)."""
    return tiers_now is None or StorageTier.S3 in tiers_now


def checkpoint_on_s3(checkpoint: Checkpoint) -> bool:
    """on_s3 of the Checkpoint's tiers as its status says them now."""
    return on_s3(checkpoint.status.tiers if checkpoint.status else None)


def missing_parts(copies: Iterable[MemoryCopy], parts: Iterable[str]) -> list[str]:
    """The parts that have no copy among `copies`: a memory-only checkpoint cannot be restored without
    them."""
    held = {copy.part for copy in copies}
    return sorted(set(parts) - held)


def readable_copies(copies: Iterable[MemoryCopy], living: Collection[str]) -> list[MemoryCopy]:
    """The copies a restore may read: those whose holder has a ready agent. Anything else (a dead holder,
    a copy replaced since by the job's next checkpoint) is read from S3: the chunks are verified by id, so
    a missing or stale copy costs time, never correctness."""
    return [copy for copy in copies if copy.node in living]


def held_now(
    copies: Iterable[MemoryCopy], listings: Mapping[str, HeldCopies | None], job: str, checkpoint: str
) -> tuple[list[MemoryCopy], list[MemoryCopy]]:
    """Of the recorded copies, (held, gone): held, those their holder lists now, sealed; gone, those
    whose holder answered (`listings`: its answer, None when it gave none) without them. A holder that
    restarted, dropped the copy for its budget or replaced it with the job's next checkpoint no longer
    has it: a restore is not sent there, and the Checkpoint stops saying so. A holder that did not
    answer may still have it: not read now, not forgotten either."""
    listed: set[tuple[str, str]] = set()
    for node, listing in listings.items():
        if listing is not None:
            mine = (c for c in listing.copies if c.sealed and (c.job, c.checkpoint) == (job, checkpoint))
            listed |= {(node, c.part) for c in mine}
    held, gone = [], []
    for copy in copies:
        if (copy.node, copy.part) in listed:
            held.append(copy)
        elif listings.get(copy.node) is not None:
            gone.append(copy)
    return held, gone


def sealed_copies(
    holders: Mapping[str, str], listings: Mapping[str, HeldCopies | None], job: str, checkpoint: str
) -> list[MemoryCopy]:
    """The checkpoint's copies that their holder lists sealed now, in part order. `holders`: each part's
    node told to keep it; `listings`: each holder's answer (None: it gave none)."""
    found = []
    for part, node in sorted(holders.items()):
        listing = listings.get(node)
        for c in listing.copies if listing is not None else []:
            if c.sealed and (c.job, c.checkpoint, c.part) == (job, checkpoint, part):
                found.append(MemoryCopy(part=part, node=node, chunks=c.chunks, bytes=c.bytes))
                break
    return found


def replaced(older: Iterable[MemoryCopy], newer: Iterable[MemoryCopy]) -> list[MemoryCopy]:
    """An older checkpoint's copies that are still held once the same job's newer copies were sealed: a
    holder keeps one copy of each job's part, the latest (agent/memorytier.py)."""
    taken = {(copy.node, copy.part) for copy in newer}
    return [copy for copy in older if (copy.node, copy.part) not in taken]
