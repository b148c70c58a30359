"""Client of a libibckpt control socket (protocol version 1, see docs/native-shim.md).

One request line, one reply line (`ok {json}` or `err {json}`), one fresh connection per command, so
no connection is open while the process is dumped. The verbs' lines (`lines`) and the reply's parse
are shared by the blocking client (ShimControl: tests, the guests' scripts, the command line) and the
event-loop one (AsyncShimControl: the node agent). Standard library only: it runs in slow TCG guests,
and it imports nothing of ibckpt, ibckpt_node or ibckpt_operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PROTO_VERSION = 1


class ControlError(RuntimeError):
    """The shim answered `err`."""

    def __init__(self, command: str, reply: dict[str, Any]) -> None:
        super().__init__(f"{command}: {reply.get('error', reply)}")
        self.reply = reply


class lines:  # a namespace: lines.quiesce(ms) reads as the line it builds
    """The request line of each verb, as native/src/cmdline.c parses it (`VERB [A [B]] [quiet]`)."""

    @staticmethod
    def quiesce(timeout_ms: int) -> str:
        return f"quiesce {timeout_ms}"

    @staticmethod
    def drain(timeout_ms: int, stall_ms: int | None = None) -> str:
        """stall_ms: how long without a completion ends the drain (the shim's default if None)."""
        return f"drain {timeout_ms}" + ("" if stall_ms is None else f" {stall_ms}")

    @staticmethod
    def release(timeout_ms: int, quiet: bool = False) -> str:
        """quiet: wait for the CQs to stay quiet instead of counting the flushes."""
        return f"release {timeout_ms}" + (" quiet" if quiet else "")

    @staticmethod
    def rebuild(epoch: int, timeout_ms: int) -> str:
        return f"rebuild {epoch} {timeout_ms}"

    @staticmethod
    def lease(ms: int) -> str:
        """Renew the lease for ms; 0 hands the rank over with no bound."""
        return f"lease {ms}"


MAX_REPLY = 1 << 20  # a status of thousands of QPs is a few hundred KiB


def parse_reply(command: str, raw: bytes) -> dict[str, Any]:
    """The reply's JSON object; ControlError if the shim said `err`, and for anything that is not
    `ok|err [JSON object]` (the shim runs in the tenant's process: its replies are input, and a
    malformed one must take the same abort path as a refusal)."""

    def malformed(why: str) -> ControlError:
        shown = raw[:200].decode(errors="replace").strip()
        return ControlError(command, {"error": f"malformed reply ({why}): {shown!r}"})

    if len(raw) > MAX_REPLY:
        raise malformed(f"{len(raw)} bytes, over {MAX_REPLY}")
    try:
        status, _, body = raw.decode().strip().partition(" ")
        reply = json.loads(body) if body else {}
    except ValueError as error:  # not UTF-8, or not JSON: a cut line, say
        raise malformed(str(error)) from None
    if status not in ("ok", "err") or not isinstance(reply, dict):
        raise malformed(f"status {status!r} and a {type(reply).__name__}")
    if status != "ok":
        raise ControlError(command, reply)
    return reply


@contextlib.contextmanager
def unfollowed(path: str) -> Iterator[str]:
    """An address that reaches the socket at `path` without following a symlink there: the socket's
    directory belongs to the container, which could swap in a link to any socket on the node between
    the agent's listing and its connect. Yields /proc/self/fd/N of an O_PATH fd checked to be a socket."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, "not a socket (a symlink is not followed)", path)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def exchange_line(s: socket.socket, line: str) -> bytes:
    """Sends one request line on a connected socket and reads back the one reply line (or what
    came before the peer closed). The shim's control socket and its coordinator both speak so."""
    s.sendall(line.encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


@dataclass
class ShimControl:
    """One process's control socket, blocking."""

    path: str
    timeout: float = 120.0

    def command(self, line: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            with unfollowed(self.path) as address:
                s.connect(address)
            return parse_reply(line, exchange_line(s, line))

    def hello(self) -> dict[str, Any]:
        reply = self.command("hello")
        if reply.get("proto") != PROTO_VERSION:
            raise ControlError("hello", {"error": f"protocol {reply.get('proto')} != {PROTO_VERSION}"})
        return reply

    def status(self) -> dict[str, Any]:
        return self.command("status")

    def quiesce(self, timeout_ms: int = 10000) -> dict[str, Any]:
        return self.command(lines.quiesce(timeout_ms))

    def drain(self, timeout_ms: int = 10000, stall_ms: int | None = None) -> dict[str, Any]:
        return self.command(lines.drain(timeout_ms, stall_ms))

    def release(self, timeout_ms: int = 10000) -> dict[str, Any]:
        return self.command(lines.release(timeout_ms))

    def rebuild(self, epoch: int, timeout_ms: int = 30000) -> dict[str, Any]:
        return self.command(lines.rebuild(epoch, timeout_ms))

    def resume(self) -> dict[str, Any]:
        return self.command("resume")

    def abort(self) -> dict[str, Any]:
        return self.command("abort")


@dataclass
class AsyncShimControl:
    """One process's control socket, on the event loop.

    No thread per rank: on a small node, creating and scheduling one thread per rank next to
    busy-polling ranks cost more than the shim's own quiesce. `timeout_s` bounds the connect and
    the reply, each."""

    path: str
    reply_limit: int  # a status or rebuild reply lists every QP of the rank

    async def command(self, line: str, timeout_s: float = 600.0) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            with unfollowed(self.path) as address:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address), timeout_s)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=self.reply_limit)
        except BaseException:
            sock.close()
            raise
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.readline(), timeout_s)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return parse_reply(line, raw)

    async def status(self, timeout_s: float = 600.0) -> dict[str, Any]:
        return await self.command("status", timeout_s)

    async def quiesce(self, timeout_ms: int) -> dict[str, Any]:
        return await self.command(lines.quiesce(timeout_ms))

    async def drain(self, timeout_ms: int, stall_ms: int | None = None) -> dict[str, Any]:
        return await self.command(lines.drain(timeout_ms, stall_ms))

    async def release(self, timeout_ms: int, quiet: bool = False) -> dict[str, Any]:
        return await self.command(lines.release(timeout_ms, quiet))

    async def rebuild(self, epoch: int, timeout_ms: int) -> dict[str, Any]:
        return await self.command(lines.rebuild(epoch, timeout_ms))

    async def resume(self) -> dict[str, Any]:
        return await self.command("resume")

    async def abort(self) -> dict[str, Any]:
        return await self.command("abort")

    async def lease(self, ms: int, timeout_s: float) -> dict[str, Any]:
        return await self.command(lines.lease(ms), timeout_s)


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
