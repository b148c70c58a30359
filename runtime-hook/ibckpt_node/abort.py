"""What happens on this node when a session aborts, and when the coordinator is lost after release.

Before any rank was gated (a refusal), every node is told and nothing else happens. Once ranks were
touched, every node is told, then each of this node's ranks comes back from wherever it is: a quiesced
or drained rank answers `abort` and runs again; a released one has no device state left and is rebuilt
with its peers, which needs a coordinator. Once every node had drained, some node may have released:
a drained rank resumed then would keep QPs whose peers are gone, and its released peers would wait
for its records forever. So from then on every rank is released first, and all are rebuilt together.
If the coordinator is gone (the operator restarted), the driver's `rejoin` waits for the one the next
operator opens for the recovery; if none comes, the released ranks wait, released, for a restore or a
kill (their shim's lease only says so).

A restore that fails (`abort_restore`) tells every node and resumes nothing: its ranks came back from
images, the operator deletes the pods it restored, and a rank resumed then would run the application
beside peers that never rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ibckpt.coordination.client import CoordinationAborted, CoordinatorClient, CoordinatorError
from ibckpt_native.control import ControlError
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.leases import ms
from ibckpt_node.ranks import LocalRank, NodeReport, on_all

log = logging.getLogger(__name__)

Rejoin = Callable[[], Awaitable[CoordinatorClient | None]]


async def abort_untouched(node: str, client: CoordinatorClient, cause: Exception, report: NodeReport) -> None:
    """Refused before any rank was gated: tell every node; the ranks keep running as they were."""
    log.warning("%s: refusing the checkpoint: %s", node, cause)
    if not isinstance(cause, CoordinationAborted):
        with contextlib.suppress(CoordinatorError):
            await client.abort(str(cause), refused=isinstance(cause, CheckpointRefused))
    report.outcome = "Refused"


async def abort_restore(node: str, client: CoordinatorClient, cause: Exception, report: NodeReport) -> None:
    """A restore failed on this node (a shim's bad reply included): tell every node, whose drivers then
    stop at once (NodeDriver._unless_aborted), a rank's rebuild waiting for this node's records too.
    This node's ranks stay as the failure left them, for the operator to delete their pods."""
    log.warning("%s: aborting the restore: %s", node, cause)
    if not isinstance(cause, CoordinationAborted) and not client.lost:
        with contextlib.suppress(CoordinatorError):
            await client.abort(str(cause))
    report.outcome = "Aborted"


async def abort_and_recover(
    node: str,
    client: CoordinatorClient,
    ranks: list[LocalRank],
    cause: Exception,
    epoch: int,
    rebuild_s: float,
    report: NodeReport,
    rejoin: Rejoin | None,
    before_rebuild: Callable[[LocalRank], Awaitable[None]] | None = None,
    release: Callable[[LocalRank], Awaitable[Any]] | None = None,
) -> CoordinatorClient:
    """Tell every node, then bring this node's ranks back to running from wherever they are. Returns
    the coordinator the session goes on with: `client`, or the recovery's one if it was lost.
    `before_rebuild` runs for each released rank before it is asked to rebuild (the driver learns
    its GIDs there). `release`: given once every node had drained; each rank is released with it
    first (one already released says so), and rebuilt."""
    log.warning("%s: aborting checkpoint: %s", node, cause)
    if not isinstance(cause, CoordinationAborted) and not client.lost:
        # Already aborted by someone else, or the coordinator is gone: recover regardless.
        with contextlib.suppress(CoordinatorError):
            await client.abort(str(cause))

    async def reopen(r: LocalRank) -> tuple[dict[str, Any] | None, bool]:
        """The rank's abort reply, or whether it is released (it needs a rebuild with its peers)."""
        if release is not None:
            try:
                await release(r)
                return None, True
            except (ControlError, OSError, TimeoutError) as exc:
                state = exc.reply.get("state") if isinstance(exc, ControlError) else None
                if state == "released":
                    return None, True
                if state not in ("rebuilt", "running"):  # those resume as they are: peers rebuild to them
                    log.error("%s: cannot release %s to rebuild it; resuming it: %s", node, r.rank.key(), exc)
        try:
            return await r.shim.abort(), False
        except (ControlError, OSError, TimeoutError) as exc:
            if isinstance(exc, ControlError) and exc.reply.get("state") == "released":
                return None, True
            log.error("%s: could not resume %s: %s", node, r.rank.key(), exc)
            return None, False

    first = await on_all(ranks, reopen)
    replies = [reply for reply, _ in first]
    released = [i for i, (_, is_released) in enumerate(first) if is_released]
    if released and client.lost:
        rejoined = await rejoin_for(node, [ranks[i] for i in released], rejoin)
        if rejoined is None:
            released = []  # no coordinator to rebuild through: they wait, released, for a restore
        else:
            client = rejoined

    async def rebuild(r: LocalRank) -> dict[str, Any] | None:
        # The real resources are gone: rebuild with the peers (all of this node's released ranks
        # at once: they wait for each other's records).
        try:
            if before_rebuild is not None:
                await before_rebuild(r)
            await r.shim.rebuild(epoch, ms(rebuild_s))
            return await r.shim.resume()
        except (ControlError, OSError, TimeoutError) as exc:
            log.error("%s: could not rebuild %s: %s", node, r.rank.key(), exc)
            return None

    rebuilt = await asyncio.gather(*(rebuild(ranks[i]) for i in released))
    for i, reply in zip(released, rebuilt, strict=True):
        replies[i] = reply
    for r, reply in zip(ranks, replies, strict=True):
        if reply is not None:
            report.shim.setdefault("abort", {})[r.rank.key()] = reply
    report.outcome = "Aborted"
    return client


async def rejoin_for(node: str, released: list[LocalRank], rejoin: Rejoin | None) -> CoordinatorClient | None:
    """The coordinator is gone and some ranks are released: wait for the one the next operator
    opens for the recovery (their rebuild exchanges records through it). None: none came."""
    keys = ", ".join(r.rank.key() for r in released)
    if rejoin is None:
        log.error("%s: %s released and the coordinator is gone: they wait for a rebuild", node, keys)
        return None
    log.warning("%s: the coordinator is gone; %s wait for the operator's recovery", node, keys)
    client = await rejoin()
    if client is None:
        log.error("%s: no coordinator came for the recovery; %s stay released", node, keys)
        return None
    log.info("%s: rejoined the session through the operator's new coordinator", node)
    return client
