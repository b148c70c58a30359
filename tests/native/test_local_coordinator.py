"""The local coordinator the native tests use (shimtest.coordinator), on the host."""

from __future__ import annotations

import socket
from pathlib import Path

from shimtest.coordinator import Coordinator


def _exchange(path: Path, lines: list[str]) -> list[str]:
    """All requests on one connection, sent before any reply is read (a rebuild's publish)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall("".join(f"{line}\n" for line in lines).encode())
        reader = sock.makefile()
        return [reader.readline().rstrip("\n") for _ in lines]


def test_many_requests_on_one_connection_are_answered_in_order(tmp_path: Path) -> None:
    with Coordinator(tmp_path / "coord.sock") as coord:
        puts = [f"PUT e2/qp/g/{i} rec-{i}" for i in range(200)]
        assert _exchange(coord.path, [*puts, "GET e2/qp/g/7 100", "GET absent 0", "BOGUS"]) == [
            *(["OK"] * 200),
            "VAL rec-7",
            "NONE",
            "ERR",
        ]
        # and one request per connection, as before
        assert _exchange(coord.path, ["GET e2/qp/g/199 0"]) == ["VAL rec-199"]
        assert len(coord.keys()) == 200
