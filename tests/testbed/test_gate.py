"""The gate relays bytes both ways, resets every connection when cut, holds every byte when stalled, and
relays again when mended."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from testbed.gate import Gate


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:  # the gate resets it when cut
            for data in iter(lambda: conn.recv(4096), b""):
                conn.sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def ask(port: int, word: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(word)
        return sock.recv(100)


def test_relays_then_resets_when_cut_then_relays_when_mended(echo_port: int) -> None:
    gate = Gate(echo_port)
    try:
        assert ask(gate.port, b"one") == b"one"
        held = socket.create_connection(("127.0.0.1", gate.port), timeout=5)
        held.sendall(b"two")
        assert held.recv(100) == b"two"

        gate.cut()
        with pytest.raises(ConnectionResetError), held:
            held.sendall(b"three")
            held.recv(100)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            ask(gate.port, b"four")
        assert gate.refused >= 1

        gate.mend()
        assert ask(gate.port, b"five") == b"five"
    finally:
        gate.close()


def test_a_stall_holds_the_bytes_of_every_connection_until_mended(echo_port: int) -> None:
    gate = Gate(echo_port)
    try:
        held = socket.create_connection(("127.0.0.1", gate.port), timeout=5)
        gate.stall()
        held.sendall(b"one")
        held.settimeout(1.0)
        with pytest.raises(TimeoutError):
            held.recv(100)  # neither forwarded nor reset
        late = socket.create_connection(("127.0.0.1", gate.port), timeout=5)  # accepted, then held too
        late.sendall(b"two")
        gate.mend()
        held.settimeout(5)
        assert held.recv(100) == b"one"
        assert late.recv(100) == b"two"
        held.close()
        late.close()
    finally:
        gate.close()
