"""One coordination session: one checkpoint or restore of one job. Pure asyncio, no I/O.

A session knows its participants (node agents, or ranks for small jobs) up front. It
offers named barriers, a key-value store with blocking get, and routed exchange rounds
(each participant publishes segments addressed to others, then gathers what was
addressed to it). Every wait is bounded, and one abort fails every wait at once.

Each participant has a credential of its own, derived from the session's secret and its name, so
one cannot speak as another. A key belongs to the participant that claimed it first (one QP's keys
make one claim, ibckpt.coordination.keys): another participant's write of it is refused.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ibckpt.coordination.keys import PASSED_BARRIER_KEYS, Claim, claim_of

# Published data: views into received frames are kept as they are, never copied.
Blob = bytes | memoryview


class SessionAborted(Exception):
    """The session was aborted; `reason` says by whom and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CoordinationTimeout(Exception):
    """A wait ran past its bound."""


class NotAParticipant(Exception):
    """A name that is not one of the session's participants."""


class ForeignKeys(Exception):
    """A write of keys another participant claimed first; nothing of the request was stored."""

    def __init__(self, participant: str, refused: Mapping[str, str]) -> None:
        shown = ", ".join(f"{key} (claimed by {owner})" for key, owner in list(refused.items())[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        super().__init__(f"{participant} may not write another participant's keys: {shown}{more}")
        self.participant = participant
        self.refused = dict(refused)


def participant_credential(secret: bytes, participant: str) -> str:
    """The credential of `participant` in the session whose secret is `secret`: HMAC-SHA256 of its
    name, so the coordinator keeps one secret and no participant can work out another's."""
    mac = hmac.new(secret, b"ibckpt-coordinator-participant\0" + participant.encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


@dataclass
class _Round:
    """One routed exchange: segments[destination][source] = bytes."""

    segments: dict[str, dict[str, Blob]] = field(default_factory=dict)
    published: set[str] = field(default_factory=set)
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class Session:
    def __init__(
        self,
        session_id: str,
        secret: bytes,
        participants: frozenset[str],
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not participants:
            raise ValueError("a session needs at least one participant")
        self.id = session_id
        self._secret = secret
        self.participants = participants
        self.deadline = clock() + deadline_s
        self._clock = clock
        self._abort_reason: str | None = None
        self.refused = False  # the abort was a node's preflight refusal
        self._aborted = asyncio.Event()
        self._barriers: dict[str, set[str]] = {}
        self._barrier_done: dict[str, asyncio.Event] = {}
        self._values: dict[str, bytes] = {}
        self._value_set: dict[str, asyncio.Event] = {}
        self._owners: dict[Claim, str] = {}  # who claimed what first
        self._rounds: dict[str, _Round] = {}
        self.abort_listeners: list[Callable[[str], None]] = []
        # (barrier, participant) on each arrival: the operator turns them into per-pod progress.
        self.arrival_listeners: list[Callable[[str, str], None]] = []

    # -- identity -------------------------------------------------------------------------

    def credential(self, participant: str) -> str:
        """What `participant`, and nobody else, says HELLO with. A secret: never log it."""
        if participant not in self.participants:
            raise NotAParticipant(f"{participant!r} is not a participant of session {self.id}")
        return participant_credential(self._secret, participant)

    def authenticate(self, participant: str, token: str) -> bool:
        """`token` is `participant`'s own credential (another participant's is not)."""
        if participant not in self.participants:
            return False
        expected = participant_credential(self._secret, participant).encode()
        # a JSON string may hold a lone surrogate: it is a wrong token, not an error
        return hmac.compare_digest(token.encode("utf-8", "surrogatepass"), expected)

    def _check(self, participant: str, allow_aborted: bool = False) -> None:
        if participant not in self.participants:
            raise NotAParticipant(f"{participant!r} is not a participant of session {self.id}")
        if self._abort_reason is not None and not allow_aborted:
            raise SessionAborted(self._abort_reason)

    # -- abort ----------------------------------------------------------------------------

    @property
    def abort_reason(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str, refused: bool = False) -> None:
        """Fail every current and future wait with `reason`. Idempotent: the first reason wins.
        `refused`: a node's preflight refused, before any rank was gated (`refused` says so to listeners)."""
        if self._abort_reason is not None:
            return
        self._abort_reason = reason
        self.refused = refused
        self._aborted.set()
        for listener in list(self.abort_listeners):
            listener(reason)

    async def _wait(self, event: asyncio.Event, timeout_s: float, what: str, abortable: bool = True) -> None:
        """Wait for `event`, bounded by `timeout_s` and the session deadline; abort wins if abortable."""
        bound = min(timeout_s, self.deadline - self._clock()) if abortable else timeout_s
        if event.is_set():
            return
        waiters = {asyncio.ensure_future(event.wait())}
        if abortable:
            waiters.add(asyncio.ensure_future(self._aborted.wait()))
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=max(bound, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waiters:
                w.cancel()
        if abortable and self._abort_reason is not None:
            raise SessionAborted(self._abort_reason)
        if not done:
            if bound < timeout_s:
                self.abort(f"session {self.id} passed its deadline while waiting for {what}")
                raise SessionAborted(self._abort_reason or "deadline")
            raise CoordinationTimeout(f"timed out after {timeout_s:g}s waiting for {what}")

    # -- barriers -------------------------------------------------------------------------

    async def barrier(self, name: str, participant: str, timeout_s: float) -> None:
        """Return once every participant has reached barrier `name`."""
        self._check(participant)
        arrived = self._barriers.setdefault(name, set())
        done = self._barrier_done.setdefault(name, asyncio.Event())
        if participant not in arrived:
            arrived.add(participant)
            for listener in list(self.arrival_listeners):
                listener(name, participant)
        if arrived == self.participants and not done.is_set():
            if (key := PASSED_BARRIER_KEYS.get(name)) is not None:  # before anyone hears it passed
                self._store(key, b"1")
            done.set()
        try:
            await self._wait(done, timeout_s, f"barrier {name!r}")
        except CoordinationTimeout as exc:
            missing = sorted(self.participants - arrived)
            raise CoordinationTimeout(f"{exc}; missing: {', '.join(missing[:10])}") from None

    # -- key-value ------------------------------------------------------------------------
    # The key-value store outlives an abort: ranks that had already released their device
    # rebuild toward each other through it to get back to running (each get is still bounded).

    def put(self, key: str, value: bytes, participant: str) -> None:
        self.put_many({key: value}, participant)

    def put_many(self, records: Mapping[str, bytes], participant: str) -> None:
        """Store every record, or (ForeignKeys) none of them: a key another participant claimed first
        may be written by it alone. Writing the bytes already stored changes nothing and is taken (two
        nodes whose ranks share a GID both publish its preflight record)."""
        self._check(participant, allow_aborted=True)
        refused: dict[str, str] = {}
        claims: list[Claim] = []
        for key, value in records.items():
            claim = claim_of(key)
            if claim is None:
                continue
            owner = self._owners.get(claim, participant)
            if owner == participant:
                claims.append(claim)
            elif self._values.get(key) != value:
                refused[key] = owner
        if refused:
            raise ForeignKeys(participant, refused)
        for claim in claims:
            self._owners.setdefault(claim, participant)
        for key, value in records.items():
            self._store(key, value)

    def _store(self, key: str, value: bytes) -> None:
        self._values[key] = value
        self._value_set.setdefault(key, asyncio.Event()).set()

    async def get(self, key: str, participant: str, timeout_s: float) -> bytes:
        """The value of `key`, waiting up to `timeout_s` for somebody to publish it."""
        self._check(participant, allow_aborted=True)
        event = self._value_set.setdefault(key, asyncio.Event())
        await self._wait(event, timeout_s, f"key {key!r}", abortable=False)
        return self._values[key]

    # -- routed exchange ------------------------------------------------------------------

    def publish(self, round_name: str, participant: str, segments: Mapping[str, Blob]) -> None:
        """Store `participant`'s segments of round `round_name`, keyed by destination."""
        self._check(participant)
        unknown = set(segments) - self.participants
        if unknown:
            raise NotAParticipant(f"segments addressed to non-participants: {sorted(unknown)[:5]}")
        rnd = self._rounds.setdefault(round_name, _Round())
        if participant in rnd.published:
            raise ValueError(f"{participant} already published round {round_name!r}")
        for dest, data in segments.items():
            rnd.segments.setdefault(dest, {})[participant] = data
        rnd.published.add(participant)
        if rnd.published == self.participants:
            rnd.complete.set()

    async def gather(self, round_name: str, participant: str, timeout_s: float) -> dict[str, Blob]:
        """Once everyone has published round `round_name`: the segments addressed to `participant`."""
        self._check(participant)
        rnd = self._rounds.setdefault(round_name, _Round())
        try:
            await self._wait(rnd.complete, timeout_s, f"round {round_name!r}")
        except CoordinationTimeout as exc:
            missing = sorted(self.participants - rnd.published)
            raise CoordinationTimeout(f"{exc}; not published by: {', '.join(missing[:10])}") from None
        return rnd.segments.get(participant, {})
