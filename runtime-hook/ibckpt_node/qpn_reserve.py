"""Virtual QPNs kept apart between the ranks one node rebuilds (docs/native-shim.md, "Virtual ids").

A peer finds a QP by (virtual GID, virtual QPN). Ranks restored from one node share that node's GIDs as
their virtual ones, and a QP a rank makes after its rebuild takes its real QPN as its virtual one (peers
reach it with no record): that number may be one a sibling restored beside it still holds virtually.
Before the ranks of a node rebuild, the node asks each for its `status` and reserves in it the virtual
QPNs of the other ranks here that share one of its virtual GIDs (`reserve`, native/src/reserve.c); its
shim then asks the device for another number. Ranks that name one (GID, QPN) together already are a
clash: the preflight refuses to checkpoint them, and a rebuild round logs it.

Ranks with the same virtual GIDs rebuilt on other nodes are not seen here (docs/native-shim.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ibckpt_native.control import ControlError, ShimStatus
from ibckpt_node.ranks import LocalRank

log = logging.getLogger(__name__)

MAX_RUN = 65536  # QPNs one `reserve` names (native/src/reserve.c)


def runs(qpns: Iterable[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive QPNs, in order, none longer than MAX_RUN."""
    out: list[tuple[int, int]] = []
    for q in sorted(set(qpns)):
        if out and out[-1][0] + out[-1][1] == q and out[-1][1] < MAX_RUN:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((q, 1))
    return out


@dataclass(frozen=True)
class Plan:
    reserved: dict[str, list[tuple[int, int]]]  # rank key -> runs of its siblings' virtual QPNs
    clashes: list[str]  # "A and B both hold GID/QPN", one per pair found


def plan(statuses: Mapping[str, ShimStatus]) -> Plan:
    """What each rank must not hand out: the virtual QPNs of the other ranks that share a virtual GID
    with it (an all-zero GID is an unset table entry, no identity)."""
    holders: dict[tuple[str, int], str] = {}
    clashes: list[str] = []
    by_gid: dict[str, dict[str, set[int]]] = {}
    for key, status in sorted(statuses.items()):
        gids = {g for g in status.gids if int(g, 16)}
        qpns = {qpn for qpn, _ in status.qps}
        for g in sorted(gids):
            by_gid.setdefault(g, {})[key] = qpns
            for q in sorted(qpns):
                other = holders.setdefault((g, q), key)
                if other != key:
                    clashes.append(f"{other} and {key} both hold virtual QP {g}/{q}")
    reserved: dict[str, list[tuple[int, int]]] = {}
    for key, status in statuses.items():
        theirs: set[int] = set()
        for g in {g for g in status.gids if int(g, 16)}:
            for other, qpns in by_gid.get(g, {}).items():
                if other != key:
                    theirs |= qpns
        reserved[key] = runs(theirs)
    return Plan(reserved, clashes)


async def reserve_round(node: str, ranks: Sequence[LocalRank], bound_s: float) -> dict[str, ShimStatus]:
    """Before `ranks` rebuild: their statuses (those that answered), each told its siblings' QPNs. A rank
    that does not answer, or whose shim predates `reserve`, rebuilds without (logged)."""
    answers = await asyncio.gather(*(r.shim.status(bound_s) for r in ranks), return_exceptions=True)
    statuses: dict[str, ShimStatus] = {}
    for r, answer in zip(ranks, answers, strict=True):
        if isinstance(answer, ShimStatus):
            statuses[r.rank.key()] = answer
        elif isinstance(answer, (ControlError, OSError, TimeoutError)):
            log.warning("%s: %s: no status before its rebuild, no QPNs reserved: %s", node, r.rank.key(),
                        answer)  # fmt: skip
        else:
            raise answer
    found = plan(statuses)
    for clash in found.clashes:
        log.error("%s: %s: their peers' records of it will name one of them only", node, clash)

    async def tell(r: LocalRank, given: list[tuple[int, int]]) -> None:
        key = r.rank.key()
        try:
            await r.shim.reserve(0, 0, bound_s)
            for first, count in given:
                await r.shim.reserve(first, count, bound_s)
        except ControlError as exc:
            if exc.reply.get("error") == "unknown command":
                log.info("%s: %s: its shim reserves no QPNs (built before reserve)", node, key)
                return
            log.warning("%s: %s: QPNs not reserved: %s", node, key, exc)
        except (OSError, TimeoutError) as exc:
            log.warning("%s: %s: QPNs not reserved: %s", node, key, exc)
        else:
            if given:
                total = sum(c for _, c in given)
                log.info("%s: %s: %d virtual QPNs of its siblings reserved", node, key, total)

    await asyncio.gather(*(tell(r, found.reserved[r.rank.key()]) for r in ranks if r.rank.key() in statuses))
    return statuses
