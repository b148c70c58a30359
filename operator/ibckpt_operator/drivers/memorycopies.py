"""The operator's side of the memory tier (docs/recovery.md, "Tiers") after a commit: which of a
Checkpoint's copies their holders still keep, what its status says about them, and their removal with
the Checkpoint. The placement and the rules are machine/memorytier.py's; the copies are the agents'."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ibckpt.agentapi import AgentError
from ibckpt.agentapi.memory import HeldCopies
from ibckpt.api import CHECKPOINT, Checkpoint, MemoryCopy
from ibckpt_operator.cluster.agents import Agent, each_agent, ready_agents
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import memorytier

log = logging.getLogger(__name__)


def recorded(checkpoint: Checkpoint) -> list[MemoryCopy]:
    return list((checkpoint.status.memory_copies if checkpoint.status else None) or [])


async def listings(rt: Runtime, holders: dict[str, Agent]) -> dict[str, HeldCopies | None]:
    """Each holder's list of what it keeps; None for one that did not answer (it is read as holding
    nothing: its chunks come from S3)."""
    nodes = sorted(holders)
    answers = await each_agent([rt.gateway.held_copies(holders[node]) for node in nodes])
    found: dict[str, HeldCopies | None] = {}
    for node, answer in zip(nodes, answers, strict=True):
        if isinstance(answer, AgentError):
            log.info("memory tier: the agent of %s did not list its copies: %s", node, answer)
            found[node] = None
        else:
            found[node] = answer
    return found


async def held_now(rt: Runtime, checkpoint: Checkpoint) -> tuple[list[MemoryCopy], dict[str, Agent]]:
    """The checkpoint's copies that their holder, a ready agent, lists now; and the ready agents. The
    Checkpoint's status stops listing the copies a holder answered it no longer has."""
    copies = recorded(checkpoint)
    if not copies:
        return [], {}
    agents = await ready_agents(rt.kube)
    living = memorytier.readable_copies(copies, agents)
    answers = await listings(rt, {c.node: agents[c.node] for c in living})
    job, name = checkpoint.spec.job_name or "", checkpoint.spec.checkpoint_id or ""
    held, gone = memorytier.held_now(living, answers, job, name)
    if gone:
        await say_held(rt, checkpoint, [c for c in copies if c not in gone])
    return held, agents


async def say_held(rt: Runtime, checkpoint: Checkpoint, copies: list[MemoryCopy]) -> None:
    """Write which copies are held, and so which tiers hold the checkpoint, into its status."""
    meta = checkpoint.metadata
    assert meta is not None and meta.name and meta.namespace
    parts = checkpoint.spec.nodes or []
    on_s3 = memorytier.checkpoint_on_s3(checkpoint)
    status: dict[str, object] = {
        "tiers": [t.value for t in memorytier.tiers(copies, parts, on_s3)],
        "memoryCopies": [c.to_wire() for c in copies] or None,  # null: the merge patch removes the field
    }
    if not on_s3 and (lost := memorytier.missing_parts(copies, parts)):
        # committed on the memory tier, not yet in S3: never half-restored from what is left
        status["readyToRestore"] = False
        status["message"] = (
            f"not restorable: the memory copy of part {', '.join(lost)} is lost and the checkpoint's S3 "
            "upload was not merged"
        )
    try:
        await rt.kube.patch_status(CHECKPOINT.plural, meta.namespace, meta.name, status)
    except Exception as error:  # the status is advice: a restore asks the holders again
        log.warning(
            "checkpoint %s/%s: memory copies not updated in status: %s", meta.namespace, meta.name, error
        )
        return
    held = ", ".join(f"{c.part} on {c.node}" for c in copies) or "none"
    log.info("checkpoint %s/%s: memory copies held: %s; tiers now %s",
             meta.namespace, meta.name, held, status["tiers"])  # fmt: skip


WATCH_EVERY_S = 1.0


async def record_when_sealed(
    rt: Runtime, namespace: str, name: str, job: str, holders: dict[str, str], bound_s: float
) -> None:
    """commitOn S3: each node copies its part to its buddy after its session reported, so the job commits
    without waiting for the copies. Ask the holders (`holders`: part -> node) until each lists its part
    sealed, or for `bound_s`; then the Checkpoint lists what they hold, and the job's older Checkpoints
    stop listing the copies these replaced. Runs detached from the job; an error is only logged."""
    try:
        deadline = time.monotonic() + bound_s
        while True:
            ready = await ready_agents(rt.kube)
            asked = {node: ready[node] for node in set(holders.values()) if node in ready}
            found = memorytier.sealed_copies(holders, await listings(rt, asked), job, name)
            if len(found) == len(holders) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(WATCH_EVERY_S)
        if missed := sorted(set(holders) - {c.part for c in found}):
            log.warning("checkpoint %s/%s: no memory copy of part %s sealed within %gs: in S3 only",
                        namespace, name, ", ".join(missed), bound_s)  # fmt: skip
        body = await rt.kube.get_custom(CHECKPOINT.plural, namespace, name)
        if body is None or not found:  # deleted meanwhile, or nothing to say
            return
        await say_held(rt, Checkpoint.from_wire(body), found)
        await forget_replaced(rt, namespace, job, name, found)
    except Exception as error:
        log.warning("checkpoint %s/%s: its memory copies not recorded: %s", namespace, name, error)


async def forget_replaced(
    rt: Runtime, namespace: str, job: str, newest: str, copies: list[MemoryCopy]
) -> None:
    """The job's older Checkpoints stop listing the copies that the newest one's replaced on their holders
    (each keeps one copy per part of a job). Only those created before it: the watch of an older one
    that ends late (record_when_sealed) must not strip a newer one's copies."""
    if not copies:
        return
    bodies = await rt.kube.list_custom(CHECKPOINT.plural)
    newest_made = next(
        (
            made(body)
            for body in bodies
            if (made(body, "namespace"), made(body, "name")) == (namespace, newest)
        ),
        None,
    )
    for body in bodies:
        with contextlib.suppress(ValueError):
            older = Checkpoint.from_wire(body)
            meta = older.metadata
            if (
                meta is None
                or meta.namespace != namespace
                or meta.name == newest
                or older.spec.job_name != job
            ):
                continue
            older_made = made(body)
            # RFC 3339 in UTC: ordered as strings; the same second is not known to be older
            if not newest_made or not older_made or older_made >= newest_made:
                continue
            before = recorded(older)
            kept = memorytier.replaced(before, copies)
            if len(kept) < len(before):
                await say_held(rt, older, kept)


def made(body: dict[str, Any], field: str = "creationTimestamp") -> str | None:
    """A field of a Checkpoint body's metadata (by default when it was created), read before validation."""
    meta = body.get("metadata")
    value = meta.get(field) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


async def drop(rt: Runtime, checkpoint: Checkpoint) -> str:
    """Ask each holder of the checkpoint's copies to drop them (a deleted Checkpoint). Returns what
    happened, for the Event; a holder that is gone or does not answer holds nothing for long (its budget
    drops the oldest copies first)."""
    copies = recorded(checkpoint)
    if not copies:
        return ""
    job, name = checkpoint.spec.job_name or "", checkpoint.spec.checkpoint_id or ""
    agents = await ready_agents(rt.kube)
    holders = sorted({c.node for c in copies})
    reachable = [n for n in holders if n in agents]
    answers = await each_agent([rt.gateway.drop_copies(agents[n], job, name) for n in reachable])
    dropped = [n for n, a in zip(reachable, answers, strict=True) if not isinstance(a, AgentError)]
    said = f"memory copies dropped on {', '.join(dropped) or 'no node'}"
    if missed := sorted(set(holders) - set(dropped)):
        said += f", not on {', '.join(missed)} (not reachable)"
    return said
