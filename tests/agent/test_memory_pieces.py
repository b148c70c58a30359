"""A copy on its way to its holder (memorycopies.Pieces) when one piece's call fails on the way: the
holder's real shelf (memorytier.MemoryShelf) behind a client that loses a request or its answer, as a
holder slow to read a piece under load does (HTTP 408, or no answer)."""

from __future__ import annotations

import hashlib
import time

import pytest

from ibckpt.agentapi.client import AgentError
from ibckpt.agentapi.memory import PIECE_BYTES, HeldCopies, HeldCopy, MemorySeal
from ibckpt_node.agent.memorycopies import Pieces
from ibckpt_node.agent.memorytier import MemoryShelf, ShelfError

KEY = ("job", "ckpt-1", "node-1")


class LossyHolder:
    """MemoryShelf's calls as MemoryClient makes them. `lose` maps a put's number (from 0) to what goes
    wrong: "request" (the holder never gets the piece: 408) or "answer" (it keeps it, the answer is
    lost)."""

    def __init__(self, lose: dict[int, str]) -> None:
        self.shelf = MemoryShelf("node-2", budget=64 * PIECE_BYTES)
        self.lose = lose
        self.puts: list[int] = []  # the piece index of every put, in order

    def put_piece(self, job: str, checkpoint: str, part: str, index: int, data: bytes) -> None:
        call = len(self.puts)
        self.puts.append(index)
        if self.lose.get(call) == "request":
            raise AgentError(408, "request not received in time")
        try:
            self.shelf.put_piece((job, checkpoint, part), index, data)
        except ShelfError as error:
            raise AgentError(error.status, str(error)) from error
        if self.lose.get(call) == "answer":
            raise AgentError(0, "PUT: The read operation timed out")

    def seal(self, job: str, checkpoint: str, part: str, seal: MemorySeal) -> HeldCopy:
        return self.shelf.seal((job, checkpoint, part), seal)

    def copies(self) -> HeldCopies:
        return self.shelf.listing()


def _cid(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _send(holder: LossyHolder, chunks: list[bytes]) -> HeldCopy:
    pieces = Pieces(holder, KEY, time.monotonic() + 60)  # type: ignore[arg-type]
    for n, chunk in enumerate(chunks):
        pieces.add(_cid(n), chunk)
    return pieces.seal(None)


def _chunks() -> list[bytes]:
    # 3.5 pieces' worth, in chunks that straddle the pieces' edges
    size = PIECE_BYTES * 7 // 8
    return [bytes([n + 1]) * size for n in range(4)]


def _assert_whole(holder: LossyHolder, held: HeldCopy, chunks: list[bytes]) -> None:
    assert held.sealed and held.bytes == sum(map(len, chunks)) and held.chunks == len(chunks), held
    for n, chunk in enumerate(chunks):
        got = holder.shelf.chunk(KEY, _cid(n))
        assert got is not None and bytes(got) == chunk, n


@pytest.mark.parametrize("call", [0, 2])  # the first piece (which starts a copy), a later one
def test_a_piece_the_holder_never_got_is_sent_again(call: int) -> None:
    holder = LossyHolder({call: "request"})
    chunks = _chunks()
    held = _send(holder, chunks)
    _assert_whole(holder, held, chunks)
    assert holder.puts == sorted([0, 1, 2, 3, call]), holder.puts  # the lost one twice, in its turn


def test_a_piece_whose_answer_was_lost_is_not_sent_again() -> None:
    holder = LossyHolder({1: "answer"})
    chunks = _chunks()
    held = _send(holder, chunks)
    _assert_whole(holder, held, chunks)
    assert holder.puts == [0, 1, 2, 3], holder.puts


def test_a_piece_lost_twice_fails_the_copy() -> None:
    holder = LossyHolder({1: "request", 2: "request"})
    with pytest.raises(AgentError, match="408"):
        _send(holder, _chunks())
    assert holder.puts == [0, 1, 1], holder.puts
    [held] = holder.copies().copies
    assert not held.sealed, held  # never listed as a copy


def test_a_refused_piece_is_not_sent_again() -> None:
    holder = LossyHolder({})
    holder.shelf.budget = PIECE_BYTES  # room for one piece only: the second is refused (507)
    with pytest.raises(AgentError) as refused:
        _send(holder, _chunks())
    assert refused.value.status not in (0, 408), refused.value
    assert holder.puts == [0, 1], holder.puts


def test_a_copy_gone_from_the_holder_is_not_continued() -> None:
    holder = LossyHolder({1: "request"})
    pieces = Pieces(holder, KEY, time.monotonic() + 60)  # type: ignore[arg-type]
    chunks = _chunks()
    pieces.add(_cid(0), chunks[0])
    pieces.add(_cid(1), chunks[1])  # piece 0 is sent
    holder.shelf.drop(*KEY[:2])  # the holder made room for another job
    with pytest.raises(AgentError, match="408"):
        pieces.add(_cid(2), chunks[2])  # piece 1 is lost, and the holder has no copy to add it to
    assert holder.puts == [0, 1], holder.puts
