"""The shims' leases while the agent holds ranks out of running (docs/native-shim.md, "Lease").

From the first quiesce until resume, abort or the kill, every held rank's lease is renewed; a rank whose
agent died resumes on its own (or, released, says it waits). Renewals stop while CRIU dumps a rank, and
a rank left held when the session ends (a Hold checkpoint) is handed over with `lease 0`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from ibckpt_native.control import ControlError
from ibckpt_node.ranks import SHIM_CLOSES_S, LocalRank, on_all

log = logging.getLogger(__name__)


def ms(seconds: float) -> int:
    """A bound in seconds as the shim's milliseconds (at least 1: 0 means none)."""
    return max(1, int(seconds * 1000))


class RankLeases:
    """Renews the leases of `ranks` (the driver's list: ranks added later, by a restore, too)."""

    def __init__(self, node: str, ranks: list[LocalRank], lease_s: float, renew_s: float) -> None:
        self.node = node
        self.ranks = ranks
        self.lease_s = lease_s
        self.renew_s = renew_s
        self._leases: asyncio.Task[None] | None = None
        self._renewals: dict[str, asyncio.Task[None]] = {}  # rank key -> its renewal in flight
        self._unrenewed: set[str] = set()  # rank keys CRIU is dumping: no renewal reaches them

    def start(self) -> None:
        """Renew every held rank's lease until stop; ranks added later (a restore) too."""
        if self._leases is None or self._leases.done():
            self._leases = asyncio.create_task(self._renew(), name=f"{self.node} leases")

    async def _renew(self) -> None:
        lease_ms = ms(self.lease_s)
        # one renewal in flight per rank: a rank busy with a long command (its rebuild) delays
        # only its own, and the shim does not count a command's time against the lease
        inflight = self._renewals

        async def renew(r: LocalRank) -> None:
            try:
                await r.shim.lease(lease_ms, self.lease_s)
            except (ControlError, OSError, TimeoutError, ValueError) as exc:
                log.warning("%s: lease renewal of %s (pid %d): %s", self.node, r.rank.key(), r.pid, exc)

        try:
            while True:
                await asyncio.sleep(self.renew_s)
                for r in list(self.ranks):
                    task = inflight.get(r.rank.key())
                    if (task is None or task.done()) and r.rank.key() not in self._unrenewed:
                        inflight[r.rank.key()] = asyncio.create_task(renew(r))
        finally:
            # None may still be on its way once stop() returns, and none is cut off: one cancelled
            # mid-send still reached its shim, after the `lease 0` that end() sent next, and armed a
            # lease on a rank handed over to wait unbounded. Each is bounded by lease_s.
            await asyncio.gather(*inflight.values(), return_exceptions=True)

    @contextlib.asynccontextmanager
    async def unrenewed_while_dumped(self, ranks: Sequence[LocalRank]) -> AsyncIterator[None]:
        """No lease renewal reaches these ranks while CRIU dumps them. The shim accepts each renewal on a
        socket of the agent's network namespace (a unix socket's accepted end is made in the connecting
        side's), and CRIU, looking for the container's sockets in the container's, failed the dump with
        `Unix socket ... not found` when one was open at the freeze. A released rank whose lease runs out
        only says so, so a long dump costs nothing."""
        keys = {r.rank.key() for r in ranks}
        self._unrenewed |= keys
        inflight = [t for k, t in self._renewals.items() if k in keys and not t.done()]
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
            await asyncio.sleep(SHIM_CLOSES_S)
        try:
            yield
        finally:
            self._unrenewed -= keys

    async def stop(self) -> None:
        task, self._leases = self._leases, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def end(self) -> None:
        """The session ends: stop renewing. Ranks left held (a Hold checkpoint) are handed over
        with `lease 0`: they wait, with no bound, for a restore session or a kill."""
        held = self._leases is not None
        await self.stop()
        if not held:
            return

        async def hand_over(r: LocalRank) -> None:
            try:
                await r.shim.lease(0, self.lease_s)
            except (ControlError, OSError, TimeoutError, ValueError) as exc:
                log.warning("%s: could not end the lease of %s: %s", self.node, r.rank.key(), exc)

        await on_all(self.ranks, hand_over)
