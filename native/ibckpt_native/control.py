"""Client of a libibckpt control socket (protocol version 1, see docs/native-shim.md)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

PROTO_VERSION = 1


class ControlError(RuntimeError):
    """The shim answered `err`."""

    def __init__(self, command: str, reply: dict[str, Any]) -> None:
        super().__init__(f"{command}: {reply.get('error', reply)}")
        self.reply = reply


@dataclass
class ShimControl:
    """One process's control socket. Each command uses a fresh connection, so no
    connection is open while the process is dumped."""

    path: str
    timeout: float = 120.0

    def command(self, line: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.path)
            s.sendall(line.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        text = buf.decode().strip()
        status, _, body = text.partition(" ")
        reply: dict[str, Any] = json.loads(body) if body else {}
        if status != "ok":
            raise ControlError(line, reply)
        return reply

    def hello(self) -> dict[str, Any]:
        reply = self.command("hello")
        if reply.get("proto") != PROTO_VERSION:
            raise ControlError("hello", {"error": f"protocol {reply.get('proto')} != {PROTO_VERSION}"})
        return reply

    def status(self) -> dict[str, Any]:
        return self.command("status")

    def quiesce(self, timeout_ms: int = 10000) -> dict[str, Any]:
        return self.command(f"quiesce {timeout_ms}")

    def drain(self, timeout_ms: int = 10000, stall_ms: int | None = None) -> dict[str, Any]:
        """stall_ms: how long without a completion ends the drain (the shim's default if None)."""
        return self.command(f"drain {timeout_ms}" + ("" if stall_ms is None else f" {stall_ms}"))

    def release(self, timeout_ms: int = 10000) -> dict[str, Any]:
        return self.command(f"release {timeout_ms}")

    def rebuild(self, epoch: int, timeout_ms: int = 30000) -> dict[str, Any]:
        return self.command(f"rebuild {epoch} {timeout_ms}")

    def resume(self) -> dict[str, Any]:
        return self.command("resume")

    def abort(self) -> dict[str, Any]:
        return self.command("abort")


def main(argv: list[str] | None = None) -> int:
    """`python -m ibckpt_native.control SOCKET COMMAND...`: send one command, print the reply as JSON."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m ibckpt_native.control SOCKET COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        reply = ShimControl(args[0]).command(" ".join(args[1:]))
    except (OSError, ControlError) as exc:
        print(f"{args[0]}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(reply))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
