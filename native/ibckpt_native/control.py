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
import re
import socket
import stat
from collections.abc import Iterator, Mapping
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

    @staticmethod
    def itimer(which: int, us: int) -> str:
        """Arm interval timer `which` (0 real, 1 virtual, 2 prof) one-shot for `us` if it is not armed."""
        return f"itimer {which} {us}"

    @staticmethod
    def reserve(first: int, count: int = 1) -> str:
        """Keep virtual QPNs [first, first + count) from the QPs the rank makes; first 0 empties the set."""
        return f"reserve {first} {count}" if first else "reserve 0"

    @staticmethod
    def devmap(old: str | None, new: str = "") -> str:
        """Reopen the context that was on device `old` on device `new` at the next rebuild; old None
        empties the map (a rebuild that goes well empties it too). Names are single words of at most
        63 characters, as the kernel's are."""
        if old is None:
            return "devmap -"
        for name in (old, new):
            if not name or len(name) > 63 or name == "-" or any(c.isspace() for c in name):
                raise ValueError(f"not a device name: {name!r}")
        return f"devmap {old} {new}"


MAX_REPLY = 1 << 20  # a status of thousands of QPs is a few hundred KiB


def _shown(raw: bytes | str) -> str:
    text = raw if isinstance(raw, str) else raw[:200].decode(errors="replace")
    return text[:200].strip()


def invalid(command: str, why: str, shown: bytes | str) -> ControlError:
    """A reply the agent will not act on: the same error as a refusal, so it takes the abort path."""
    return ControlError(command, {"error": f"malformed reply ({why}): {_shown(shown)!r}"})


def parse_reply(command: str, raw: bytes) -> dict[str, Any]:
    """The reply's JSON object; ControlError if the shim said `err`, and for anything that is not
    `ok|err [JSON object]` (the shim runs in the tenant's process: its replies are input, and a
    malformed one must take the same abort path as a refusal)."""
    if len(raw) > MAX_REPLY:
        raise invalid(command, f"{len(raw)} bytes, over {MAX_REPLY}", raw)
    try:
        status, _, body = raw.decode().strip().partition(" ")
        reply = json.loads(body) if body else {}
    except ValueError as error:  # not UTF-8, or not JSON: a cut line, say
        raise invalid(command, str(error), raw) from None
    if status not in ("ok", "err") or not isinstance(reply, dict):
        raise invalid(command, f"status {status!r} and a {type(reply).__name__}", raw)
    if status != "ok":
        raise ControlError(command, reply)
    return reply


# -- what a reply may say (native/src/phase.c, report.c) --------------------------------------

STATES = frozenset({"running", "quiesced", "drained", "released", "rebuilt"})  # ibk_phase_name
# Where a phase that went well (`"ok": true`) leaves the rank; `lease` leaves it where it was.
STATE_AFTER = {
    "quiesce": "quiesced",
    "drain": "drained",
    "release": "released",
    "rebuild": "rebuilt",
    "resume": "running",
    "abort": "running",
}


def checked_phase(command: str, reply: dict[str, Any]) -> dict[str, Any]:
    """A phase's `ok` reply as the agent may act on it: it answers this verb, says whether it went
    well (a bool), names a state, and the state the phase leaves when it went well; anything else is
    ControlError (review N24: a shim's reply is the tenant's input)."""
    verb = command.split()[0]
    problem = ""
    if reply.get("phase") != verb:
        problem = f"it answers phase {reply.get('phase')!r}, not {verb!r}"
    elif not isinstance(reply.get("ok"), bool):
        problem = "its 'ok' is not true or false"
    elif reply.get("state") not in STATES:
        problem = f"state {reply.get('state')!r} is none of {sorted(STATES)}"
    elif reply["ok"] and verb in STATE_AFTER and reply["state"] != STATE_AFTER[verb]:
        problem = f"a {verb} that went well leaves the rank {STATE_AFTER[verb]}, not {reply['state']}"
    elif "ms" in reply and (not isinstance(reply["ms"], int) or isinstance(reply["ms"], bool)):
        problem = "its 'ms' is not an integer"
    if problem:
        raise invalid(command, problem, json.dumps(reply))
    return reply


# What one `status` may list: a process opens at most a few devices, each with 4 GIDs (port 1's
# valid indices) and IBK_MAX_QPS (4096) QPs. More is not a rank the agent will act on: each GID and
# QP becomes coordinator keys in the preflight (a reply of 1,000 GIDs x 1,000 QPs was a million PUTs).
MAX_STATUS_GIDS = 64
MAX_STATUS_QPS = 16 * 4096
MAX_STATUS_ENTRY = 512  # characters of one `unsupported` entry
MAX_DEVICE_NAME = 63  # characters of a device name (the kernel's IB_DEVICE_NAME_MAX, NUL excluded)
MAX_DEVICE_INDEX = 1023  # a device's index in a process's device list
_GID = re.compile(r"[0-9a-fA-F]{32}")
_QPN_MAX = 0xFFFFFFFF  # a uint32 on the wire: an app may hand any dest_qp_num to modify_qp


@dataclass(frozen=True)
class ShimStatus:
    """The parts of a `status` reply the agent acts on, checked: a rank's state and its identity for
    the preflight (docs/wire-formats.md). Parse with `ShimStatus.parse`."""

    state: str | None  # None: not said (then nothing may depend on it)
    gids: tuple[str, ...]  # this rank's virtual GIDs, 32 hex digits
    qps: tuple[tuple[int, int], ...]  # (virtual QPN, QP type)
    peers: tuple[tuple[int, int, str, int], ...]  # (QPN, type, peer GID, peer QPN)
    unsupported: tuple[str, ...]
    ah_gids: tuple[str, ...]
    # (device name, index in the device list; -1 not listed) of each verbs context, oldest first; ()
    # from a shim that predates it (native/src/devmap.c: what a rebuild maps the contexts by)
    contexts: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, reply: Mapping[str, Any], command: str = "status") -> ShimStatus:
        """ControlError for a reply of the wrong shape or over the bounds above."""

        def fail(why: str) -> ControlError:
            return invalid(command, why, json.dumps(dict(reply))[:200])

        def listed(key: str, limit: int) -> list[Any]:
            value = reply.get(key, [])
            if not isinstance(value, list):
                raise fail(f"{key!r} is not a list")
            if len(value) > limit:
                raise fail(f"{len(value)} entries in {key!r}, more than the {limit} a rank may have")
            return value

        def gid(value: Any, key: str) -> str:
            if not isinstance(value, str) or not _GID.fullmatch(value):
                raise fail(f"{key!r} holds {value!r}, not a GID of 32 hex digits")
            return value.lower()

        def number(entry: Any, key: str, field: str, top: int) -> int:
            value = entry.get(field) if isinstance(entry, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                raise fail(f"an entry of {key!r} has {field} {value!r}, not an integer 0..{top}")
            return value

        def device(entry: Any) -> tuple[str, int]:
            name = entry.get("device") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not 0 < len(name) <= MAX_DEVICE_NAME:
                raise fail(f"an entry of 'contexts' has device {name!r}, not a name of 1..{MAX_DEVICE_NAME}")
            index = entry.get("index")
            if not isinstance(index, int) or isinstance(index, bool) or not -1 <= index <= MAX_DEVICE_INDEX:
                raise fail(f"an entry of 'contexts' has index {index!r}, not -1..{MAX_DEVICE_INDEX}")
            return name, index

        state = reply.get("state")
        if state is not None and state not in STATES:
            raise fail(f"state {state!r} is none of {sorted(STATES)}")
        unsupported = listed("unsupported", MAX_STATUS_QPS)
        if not all(isinstance(u, str) and len(u) <= MAX_STATUS_ENTRY for u in unsupported):
            raise fail(f"'unsupported' holds an entry that is not a string of at most {MAX_STATUS_ENTRY}")
        return cls(
            state=state,
            gids=tuple(gid(g, "gids") for g in listed("gids", MAX_STATUS_GIDS)),
            qps=tuple(
                (number(q, "qps", "qpn", _QPN_MAX), number(q, "qps", "type", 255))
                for q in listed("qps", MAX_STATUS_QPS)
            ),
            peers=tuple(
                (
                    number(p, "peers", "qpn", _QPN_MAX),
                    number(p, "peers", "type", 255),
                    gid(p.get("peer_gid"), "peers"),
                    number(p, "peers", "peer_qpn", _QPN_MAX),
                )
                for p in listed("peers", MAX_STATUS_QPS)
            ),
            unsupported=tuple(unsupported),
            ah_gids=tuple(gid(g, "ah_gids") for g in listed("ah_gids", MAX_STATUS_QPS)),
            contexts=tuple(device(c) for c in listed("contexts", MAX_STATUS_GIDS)),
        )


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
    """One process's control socket, on the event loop: the node agent's client. Every reply it acts
    on is checked (`checked_phase`, `ShimStatus`): anything else is ControlError.

    No thread per rank: on a small node, creating and scheduling one thread per rank next to
    busy-polling ranks cost more than the shim's own quiesce. `timeout_s` bounds the connect and
    the reply, each."""

    path: str
    reply_limit: int = MAX_REPLY  # bytes of one reply line; a longer one is ControlError

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
        except ValueError:  # asyncio's "separator not found, chunk exceed the limit"
            raise invalid(line, f"a line longer than {self.reply_limit} bytes", b"") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return parse_reply(line, raw)

    async def phase(self, line: str, timeout_s: float = 600.0) -> dict[str, Any]:
        return checked_phase(line, await self.command(line, timeout_s))

    async def status(self, timeout_s: float = 600.0) -> ShimStatus:
        return ShimStatus.parse(await self.command("status", timeout_s))

    async def quiesce(self, timeout_ms: int) -> dict[str, Any]:
        return await self.phase(lines.quiesce(timeout_ms))

    async def drain(self, timeout_ms: int, stall_ms: int | None = None) -> dict[str, Any]:
        return await self.phase(lines.drain(timeout_ms, stall_ms))

    async def release(self, timeout_ms: int, quiet: bool = False) -> dict[str, Any]:
        return await self.phase(lines.release(timeout_ms, quiet))

    async def rebuild(self, epoch: int, timeout_ms: int) -> dict[str, Any]:
        return await self.phase(lines.rebuild(epoch, timeout_ms))

    async def resume(self) -> dict[str, Any]:
        return await self.phase("resume")

    async def abort(self) -> dict[str, Any]:
        return await self.phase("abort")

    async def lease(self, ms: int, timeout_s: float) -> dict[str, Any]:
        return await self.phase(lines.lease(ms), timeout_s)

    async def reserve(self, first: int, count: int, timeout_s: float) -> dict[str, Any]:
        return await self.phase(lines.reserve(first, count), timeout_s)

    async def devmap(self, old: str | None, new: str, timeout_s: float) -> dict[str, Any]:
        return await self.phase(lines.devmap(old, new), timeout_s)


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
