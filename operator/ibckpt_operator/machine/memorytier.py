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
from ibckpt.api import MemoryCopy, StorageTier


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


def tiers(copies: Collection[MemoryCopy], parts: Collection[str]) -> list[StorageTier]:
    """S3 always (the commit is there); Memory when every part of the checkpoint has a kept copy."""
    held = {copy.part for copy in copies}
    if parts and set(parts) <= held:
        return [StorageTier.S3, StorageTier.MEMORY]
    return [StorageTier.S3]


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


def replaced(older: Iterable[MemoryCopy], newer: Iterable[MemoryCopy]) -> list[MemoryCopy]:
    """An older checkpoint's copies that are still held once the same job's newer copies were sealed: a
    holder keeps one copy of each job's part, the latest (agent/memorytier.py)."""
    taken = {(copy.node, copy.part) for copy in newer}
    return [copy for copy in older if (copy.node, copy.part) not in taken]
