"""Serves the shim's key-value protocol on a node-local unix socket, backed by the job coordinator.

The shim (native/src/coord.c) speaks one request per connection, in text lines:
    PUT <key> <value...>      -> OK
    GET <key> <timeout_ms>    -> VAL <value...> | NONE
The shim never talks to the network or holds a token: the node agent does, so the
coordinator's authentication stays in one place and the socket path is the same on every
node (a process restored elsewhere finds it where it was).

Each container has its own socket (a Channel): STATE_DIR/containers/ID/coord/coord.sock, which the
hook mounts read-only at /run/ibckpt/coord in that container alone, and which is served only while a
session holds ranks there. A peer must be in the pid namespace of that container's ranks
(SO_PEERCRED). Keys are confined to the shim's two kinds (`map/GID/QPN`, `eN/qp/GID/QPN`), so a
shim reads and writes nothing else of the session. A container's PUTs are confined to its ranks' own
QPs once the agent has learned them (`confine`: the driver asks each rank's `status` just before its
rebuild, the only command that publishes): a PUT naming a (virtual GID, QPN) that none of its ranks
holds is refused. The pair, not the GID alone: ranks restored from one node share its GID, but not
its QP numbers. GID 0 is anyone's (keys.py), and a container whose QPs are not learned yet is not
confined (no rank of it has been asked to rebuild by this agent, so its shim publishes nothing
legitimate meanwhile).

A rebuild PUTs two records per QP per GID and waits for each answer, so a round trip to the
coordinator per PUT adds up (hundreds per node, serialized: a rebuild took 13 s of 16 ranks'
round trips through qemu's user networking). So every PUT is answered at once and forwarded in
the background, all those queued meanwhile in one PUT_MANY request. The epoch records
(`e<N>/...`) are only read by GETs that wait for them. The `map/...` records are read without
waiting, but only by a peer's app after resume, which comes after the rebuild barrier: the
agent calls `published()` before it (NodeDriver's `flush_records`). A background PUT that fails is
logged and makes every later request fail, so the rebuild aborts instead of waiting for a
record that never comes.

A GET of an epoch record that a confined rank of this node PUT is answered from the proxy's own
copy, without the round trip to the coordinator (nor the wait for the background PUT): ranks whose
QPs connect on one node learn each other's new QPs at once (a rebuild's "peers" step fell from about
200 to 10 ms on a TCG guest). No other node may write that record (the coordinator refuses it and
the session aborts before any rank resumes), so the copy is the coordinator's value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient, CoordinatorError
from ibckpt.coordination.keys import EPOCH_RECORD, SHIM_RECORD, ZERO_GID

log = logging.getLogger(__name__)

LINE_LIMIT = 64 * 1024
MAX_GET_S = 600.0
BATCH = 4096  # PUTs forwarded in one coordinator request at most
IDLE_S = 10.0  # a shim connection with no request for this long is closed
MAX_CONNECTIONS = 256  # per container: each rank's rebuild holds one, app threads may GET meanwhile
SOCKET_NAME = "coord.sock"


def pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


@dataclass(frozen=True)
class Channel:
    """One container's socket. `pids`: host pids of its ranks, whose pid namespace a peer must be in;
    None takes any peer (the command-line tool, whose user chose the path). `owner`: uid, gid the
    socket is given (the container's user), else the agent's."""

    path: Path
    pids: frozenset[int] | None = None
    owner: tuple[int, int] | None = None


def channel_path(control_path: Path) -> Path | None:
    """The coordinator socket of the container whose rank's control socket is `control_path`
    (HOST_DIR/containers/ID/ctl/N.sock -> HOST_DIR/containers/ID/coord/coord.sock); None outside a
    container's `ctl` directory."""
    if control_path.parent.name != "ctl":
        return None
    return control_path.parent.parent / "coord" / SOCKET_NAME


def channels_for(control_paths: Iterable[tuple[Path, int]]) -> list[Channel]:
    """A channel per container of the ranks (control socket path, host pid): beside its `ctl`
    directory, owned as that directory is (the hook gave it to the container's user)."""
    pids: dict[Path, set[int]] = {}
    for path, pid in control_paths:
        if (socket_path := channel_path(path)) is not None:
            pids.setdefault(socket_path, set()).add(pid)
    channels = []
    for socket_path, found in sorted(pids.items()):
        try:
            st = os.lstat(socket_path.parent.parent / "ctl")
            owner: tuple[int, int] | None = (st.st_uid, st.st_gid)
        except OSError:
            owner = None
        channels.append(Channel(socket_path, frozenset(found), owner))
    return channels


def peer_pid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[0])


class ShimCoordinatorProxy:
    def __init__(
        self,
        client: CoordinatorClient,
        channels: Sequence[Channel],
        ns_of: Callable[[int], str] = pid_namespace,
    ) -> None:
        self.client = client
        self.channels = list(channels)
        self._ns_of = ns_of
        self._servers: list[asyncio.AbstractServer] = []
        self._open: dict[Path, int] = {}  # connections per channel
        self._puts: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._forwarder: asyncio.Task[None] | None = None
        self.failed: str | None = None  # the first background PUT that failed, and why
        # per channel, per rank learned: the GIDs and QPNs its PUTs may name together (confine)
        self._owned: dict[Path, list[tuple[frozenset[str], frozenset[int]]]] = {}
        self._refusal_logged: set[Path] = set()  # channels whose foreign PUT was logged already
        # Epoch records of this node's own ranks, by key: a GET of one is answered here (below)
        self._own_records: dict[str, str] = {}

    async def start(self) -> None:
        self._forwarder = asyncio.ensure_future(self._forward())
        for channel in self.channels:
            await self._listen(channel)

    async def add(self, channels: Iterable[Channel]) -> None:
        """Serve these containers too (a restore finds its ranks once the proxy runs)."""
        served = {c.path for c in self.channels}
        for channel in channels:
            if channel.path not in served:
                self.channels.append(channel)
                served.add(channel.path)
                await self._listen(channel)

    async def _listen(self, channel: Channel) -> None:
        namespaces: frozenset[str] | None = None
        if channel.pids is not None:
            found = set()
            for pid in channel.pids:
                with contextlib.suppress(OSError):
                    found.add(self._ns_of(pid))
            namespaces = frozenset(found)
        channel.path.parent.mkdir(mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            channel.path.unlink()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(channel, namespaces, reader, writer)

        old = os.umask(0o177)  # never connectable by anyone else, not even for a moment
        try:
            listener = bind_in_directory(channel.path)
            server = await asyncio.start_unix_server(serve, sock=listener, limit=LINE_LIMIT, backlog=1024)
        finally:
            os.umask(old)
        self._servers.append(server)
        if channel.owner is not None and channel.owner != (os.geteuid(), os.getegid()):
            os.chown(channel.path, *channel.owner)

    def confine(self, control_path: Path, gids: Iterable[str], qpns: Iterable[int]) -> None:
        """The rank whose control socket is `control_path` holds these virtual GIDs and QPs (its
        `status`): from now on its container's PUTs may name a QP of it or of its other ranks
        learned, under that rank's GIDs, and nothing else but GID 0. Called before the rank is
        asked to rebuild, so no write of it is refused."""
        socket_path = channel_path(control_path)
        if socket_path is not None:
            self.confine_socket(socket_path, gids, qpns)

    def confine_socket(self, socket_path: Path, gids: Iterable[str], qpns: Iterable[int]) -> None:
        """confine() for the channel at `socket_path` itself (the CLI's one channel for all its ranks)."""
        rank = (frozenset(g.lower() for g in gids), frozenset(qpns))
        self._owned.setdefault(socket_path, []).append(rank)

    def _foreign(self, channel: Path, gid: str, qpn: int) -> str | None:
        """Why `channel` may not write a key naming (`gid`, `qpn`); None when it may."""
        owned = self._owned.get(channel)
        if owned is None or gid == ZERO_GID:
            return None
        if any(gid in gids and qpn in qpns for gids, qpns in owned):
            return None
        if any(gid in gids for gids, _ in owned):
            return f"QP {qpn} of GID {gid} is not one of this container's ranks' QPs"
        return f"GID {gid} is not one of this container's ranks' GIDs"

    def use(self, client: CoordinatorClient) -> None:
        """Forward through `client` from now on: the coordinator that replaces a lost one. A failure
        recorded so far was the lost one's."""
        self.client = client
        self.failed = None
        self._own_records.clear()

    async def flush(self) -> None:
        """Wait until every background PUT has reached the coordinator (or failed)."""
        await self._puts.join()

    async def published(self) -> None:
        """Wait until every PUT so far has reached the coordinator; raise if one did not."""
        await self.flush()
        if self.failed is not None:
            raise CoordinatorError(f"a shim record was not published: {self.failed}")

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            await server.wait_closed()
        if self._forwarder is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), 30)
            self._forwarder.cancel()
        for channel in self.channels:
            with contextlib.suppress(FileNotFoundError):
                channel.path.unlink()

    async def __aenter__(self) -> ShimCoordinatorProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _peer_refused(self, namespaces: frozenset[str] | None, writer: asyncio.StreamWriter) -> str | None:
        if namespaces is None:
            return None
        try:
            pid = peer_pid(writer.get_extra_info("socket"))
            ns = self._ns_of(pid)
        except OSError as exc:
            return f"peer unknown ({exc})"
        return None if ns in namespaces else f"pid {pid} is not in the container's pid namespace"

    async def _serve(
        self,
        channel: Channel,
        namespaces: frozenset[str] | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Requests one per line, answered in order, until the shim closes the connection
        (a rebuild sends all its PUTs on one connection)."""
        held = self._open.get(channel.path, 0)
        try:
            why = self._peer_refused(namespaces, writer)
            if why is None and held >= MAX_CONNECTIONS:
                why = f"{held} connections open"
            if why is not None:
                log.warning("%s: refused a connection: %s", channel.path, why)
                writer.write(f"ERR refused: {why}\n".encode())
                return
            self._open[channel.path] = held + 1
            try:
                while raw := await asyncio.wait_for(reader.readline(), IDLE_S):
                    writer.write((await self.answer(raw.decode().rstrip("\n"), channel.path) + "\n").encode())
                    await asyncio.wait_for(writer.drain(), IDLE_S)
            finally:
                self._open[channel.path] -= 1
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError) as exc:
            log.warning("shim request dropped: %r", exc)
        finally:
            writer.close()

    async def _forward(self) -> None:
        """Forward background PUTs, everything queued so far in one request (a later PUT of
        the same key wins, as it would one by one)."""
        while True:
            batch = [await self._puts.get()]
            while len(batch) < BATCH and not self._puts.empty():
                batch.append(self._puts.get_nowait())
            try:
                if self.failed is None:
                    await self.client.put_many(dict(batch))
            except (CoordinatorError, OSError) as exc:
                keys = ", ".join(key for key, _ in batch[:3]) + (", ..." if len(batch) > 3 else "")
                self.failed = f"PUT {keys} failed: {exc}"
                log.error("shim records not published: %s", self.failed)
            finally:
                for _ in batch:
                    self._puts.task_done()

    async def answer(self, line: str, channel: Path) -> str:
        """The reply to one request line from the container whose socket is `channel`."""
        verb, _, rest = line.partition(" ")
        if self.failed is not None:
            return f"ERR {self.failed}"
        key, _, rest = rest.partition(" ")
        matched = SHIM_RECORD.fullmatch(key)  # what a shim publishes and reads: nothing else
        if verb in ("PUT", "GET") and matched is None:
            return "ERR not a shim record key"
        if verb == "PUT" and matched is not None:
            foreign = self._foreign(channel, matched.group(1), int(matched.group(2)))
            if foreign is not None:
                if channel not in self._refusal_logged:  # once per container: a shim may send thousands
                    self._refusal_logged.add(channel)
                    log.warning("%s: refused PUT %s: %s", channel, key, foreign)
                return f"ERR refused: {foreign}"
            self._puts.put_nowait((key, rest.encode()))
            if EPOCH_RECORD.match(key) and channel in self._owned and matched.group(1) != ZERO_GID:
                self._own_records[key] = rest
            return "OK"
        if verb == "GET" and key in self._own_records:
            return f"VAL {self._own_records[key]}"
        if verb == "GET":
            timeout = min(max(int(rest or "0"), 0) / 1000.0, MAX_GET_S)
            try:
                found = await self.client.get(key, timeout)
            except CoordinationTimedOut:
                return "NONE"
            except CoordinatorError as exc:
                # Aborted or lost: the shim's rebuild fails and the agent's abort path takes over.
                log.warning("GET %s failed: %s", key, exc)
                return "NONE"
            return f"VAL {found.decode()}"
        return "ERR unknown verb"


def bind_in_directory(path: Path) -> socket.socket:
    """A unix socket bound at `path` through its directory's fd: STATE_DIR/containers/<64-hex id>/coord/
    is longer than the 107 bytes a socket address holds, /proc/self/fd/N/NAME is not."""
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{directory}/{path.name}")
    except OSError:
        listener.close()
        raise
    finally:
        os.close(directory)
    return listener
