"""Unit tests of the pure coordination session: barriers, key-value, rounds, timeouts, abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from ibckpt.coordination.keys import RELEASING
from ibckpt_operator.coordinator.session import (
    CoordinationTimeout,
    NotAParticipant,
    Session,
    SessionAborted,
)

NODES = frozenset({"node-a", "node-b", "node-c"})


def session(deadline: float = 60.0) -> Session:
    return Session("s1", b"session-secret", NODES, deadline)


async def test_barrier_releases_only_when_everyone_arrived() -> None:
    s = session()
    a = asyncio.ensure_future(s.barrier("quiesced", "node-a", 5))
    b = asyncio.ensure_future(s.barrier("quiesced", "node-b", 5))
    await asyncio.sleep(0.05)
    assert not a.done() and not b.done()
    await s.barrier("quiesced", "node-c", 5)
    await asyncio.wait_for(asyncio.gather(a, b), 1)


async def test_the_drained_barrier_says_so_in_a_key_before_anyone_hears_it_passed() -> None:
    """A node whose own barrier call failed learns from keys.RELEASING that the others may release."""
    s = session()
    waits = [asyncio.ensure_future(s.barrier("Drained", node, 5)) for node in ("node-a", "node-b")]
    await asyncio.sleep(0.05)
    with pytest.raises(CoordinationTimeout):  # not every node drained: nobody may release
        await s.get(RELEASING, "node-a", 0.05)
    await s.barrier("Drained", "node-c", 5)
    assert await s.get(RELEASING, "node-b", 0.05) == b"1"
    await asyncio.wait_for(asyncio.gather(*waits), 1)
    other = session()  # another barrier writes nothing
    await asyncio.gather(*(other.barrier("Quiesced", node, 1) for node in NODES))
    with pytest.raises(CoordinationTimeout):
        await other.get(RELEASING, "node-a", 0.05)


async def test_barrier_timeout_names_the_missing() -> None:
    s = session()
    with pytest.raises(CoordinationTimeout, match=r"missing: node-a, node-c"):
        await s.barrier("drained", "node-b", 0.1)


async def test_abort_fails_every_wait_with_the_reason() -> None:
    s = session()
    waits = [
        asyncio.ensure_future(s.barrier("x", "node-a", 5)),
        asyncio.ensure_future(s.gather("r1", "node-c", 5)),
    ]
    await asyncio.sleep(0.05)
    heard: list[str] = []
    s.abort_listeners.append(heard.append)
    s.abort("node-b: drain timed out")
    for w in waits:
        with pytest.raises(SessionAborted, match="drain timed out"):
            await w
    assert heard == ["node-b: drain timed out"]
    with pytest.raises(SessionAborted):  # and every later call too
        await s.barrier("y", "node-a", 5)
    s.abort("second reason is ignored")
    assert s.abort_reason == "node-b: drain timed out"


async def test_deadline_aborts_the_session() -> None:
    s = session(deadline=0.1)
    with pytest.raises(SessionAborted, match="deadline"):
        await s.barrier("late", "node-a", 10)
    assert s.abort_reason is not None


async def check_get_waits_for_put(
    s: Session, key: str, value: bytes, meanwhile: Callable[[], None] = lambda: None
) -> None:
    """A get waits for another node's put of its key (`meanwhile` runs while it waits); a key that nobody
    puts times out."""
    pending = asyncio.ensure_future(s.get(key, "node-a", 5))
    meanwhile()
    await asyncio.sleep(0.02)
    assert not pending.done()
    s.put(key, value, "node-b")
    assert await pending == value
    with pytest.raises(CoordinationTimeout):
        await s.get("never", "node-a", 0.05)


async def test_get_waits_for_put() -> None:
    await check_get_waits_for_put(session(), "rank-3/qpn", b"\x01\x02")


async def test_rounds_route_segments_to_their_destination() -> None:
    s = session()
    s.publish("ids", "node-a", {"node-b": b"a->b", "node-c": b"a->c"})
    s.publish("ids", "node-b", {"node-a": b"b->a"})
    early = asyncio.ensure_future(s.gather("ids", "node-a", 5))
    await asyncio.sleep(0.02)
    assert not early.done(), "a round completes only when every participant published"
    s.publish("ids", "node-c", {"node-a": b"c->a", "node-b": b"c->b"})
    assert await early == {"node-b": b"b->a", "node-c": b"c->a"}
    assert await s.gather("ids", "node-b", 1) == {"node-a": b"a->b", "node-c": b"c->b"}
    assert await s.gather("ids", "node-c", 1) == {"node-a": b"a->c"}


async def test_strangers_and_duplicates_are_refused() -> None:
    s = session()
    mine = s.credential("node-a")
    assert s.authenticate("node-a", mine)
    assert not s.authenticate("node-a", mine[:-1] + ("x" if mine[-1] != "x" else "y"))
    assert not s.authenticate("node-z", mine)
    assert not s.authenticate("node-b", mine)  # a participant's credential is its own alone
    with pytest.raises(NotAParticipant):
        s.credential("node-z")
    with pytest.raises(NotAParticipant):
        await s.barrier("x", "node-z", 1)
    with pytest.raises(NotAParticipant):
        s.publish("r", "node-a", {"node-z": b""})
    s.publish("r", "node-a", {})
    with pytest.raises(ValueError, match="already published"):
        s.publish("r", "node-a", {})


async def test_key_value_outlives_an_abort_for_recovery() -> None:
    """Released ranks rebuild toward each other after an abort: put/get keep working, bounded."""
    s = session()
    await check_get_waits_for_put(s, "map/rank-1", b"new ids", lambda: s.abort("node-c: dump failed"))
