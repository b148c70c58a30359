"""The node agent's container registry: which containers on this node run under the shim.

`ibckpt-hook` registers a container at createRuntime and deregisters it at poststop, over a
unix socket (protocol in ibckpt_node.hook.client). The socket is root's, mode 0600, in a
directory no container sees, and every peer's uid is checked (SO_PEERCRED): only root (or the
uids given) may register, deregister or list.

The hook also leaves STATE_DIR/containers/ID/registration.json behind, so a registry that was
not running when a container started finds it by rediscover() (done at start): nothing is lost
while the agent restarts. Entries whose process is gone (or whose pid now names another process)
are dropped whenever the registry is read.

    python -m ibckpt_node.registry serve [--state-dir /run/ibckpt] [--allow-uid N ...]
    python -m ibckpt_node.registry list [--state-dir /run/ibckpt]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ibckpt_node.hook import client, oci

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024


class RegisteredContainer(BaseModel):
    """One container under (or meant for) the shim on this node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    container_id: str = Field(min_length=1, max_length=256)
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    container: str = ""
    pid: int = Field(gt=0)
    pid_start: int = Field(ge=0)
    control_dir: str = ""  # host path; the shim makes <pid in the container>.sock there
    control_socket: str = ""  # the socket of the container's first process
    shim: bool  # the shim is preloaded (the container went through ibckpt-runc)
    shim_build: str | None = None  # the sha256 of the shim build it mounts (None: before builds were kept)
    reason: str = ""
    registered_at: float

    def alive(self) -> bool:
        try:
            return client.process_start(self.pid) == self.pid_start
        except (OSError, ValueError, IndexError):
            return False

    def sockets(self) -> list[str]:
        """Control sockets the shim has made so far (one per process that opened a device)."""
        if not self.control_dir:
            return []
        try:
            names = sorted(os.listdir(self.control_dir))
        except OSError:
            return []
        found = []
        for name in names:
            path = os.path.join(self.control_dir, name)
            # the directory is the container's: a symlink there could point the agent at any host socket
            with contextlib.suppress(OSError):
                if name.endswith(".sock") and stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
        return found


def peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


class ContainerRegistry:
    """Serves the registry on STATE_DIR/registry.sock."""

    def __init__(self, state_dir: Path, allowed_uids: Sequence[int] = (0,)) -> None:
        self.config = oci.NodeConfig(state_dir=str(state_dir))
        self.socket_path = Path(self.config.registry_socket)
        self.allowed_uids = frozenset(allowed_uids)
        self._entries: dict[str, RegisteredContainer] = {}
        self._server: asyncio.AbstractServer | None = None

    # -- the registry itself ---------------------------------------------------------------

    def add(self, entry: RegisteredContainer) -> None:
        oci.checked_id(entry.container_id)
        self._entries[entry.container_id] = entry
        log.info(
            "registered %s (%s/%s container %s, pid %d, shim %s)",
            entry.container_id,
            entry.namespace,
            entry.pod,
            entry.container,
            entry.pid,
            entry.shim,
        )

    def remove(self, container_id: str) -> bool:
        found = self._entries.pop(container_id, None) is not None
        if found:
            log.info("deregistered %s", container_id)
        return found

    def entries(self) -> list[RegisteredContainer]:
        """Live entries, oldest first; dead ones are dropped."""
        for cid in [cid for cid, e in self._entries.items() if not e.alive()]:
            log.info("dropping %s: its process is gone", cid)
            del self._entries[cid]
        return sorted(self._entries.values(), key=lambda e: e.registered_at)

    def checkpointable(self) -> list[RegisteredContainer]:
        return [e for e in self.entries() if e.shim]

    def rediscover(self) -> int:
        """Read the registrations the hook left on disk (while no registry was serving)."""
        found = 0
        base = Path(self.config.state_dir) / "containers"
        for path in sorted(base.glob("*/registration.json")):
            try:
                entry = RegisteredContainer.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as exc:
                log.warning("%s: %s", path, exc)
                continue
            if entry.container_id != path.parent.name or not entry.alive():
                continue
            if entry.container_id not in self._entries:
                self._entries[entry.container_id] = entry
                found += 1
        return found

    # -- the socket --------------------------------------------------------------------------

    async def start(self) -> None:
        state = Path(self.config.state_dir)
        state.mkdir(mode=0o711, parents=True, exist_ok=True)
        found = self.rediscover()
        if found:
            log.info("rediscovered %d container(s) from %s", found, state / "containers")
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.socket_path), limit=MAX_REQUEST
            )
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def __aenter__(self) -> ContainerRegistry:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's reply (the protocol without the socket)."""
        if request.get("v") != client.PROTO_VERSION:
            return {"ok": False, "error": f"protocol version {request.get('v')!r} (want 1)"}
        op = request.get("op")
        try:
            if op == "register":
                self.add(RegisteredContainer.model_validate(request.get("entry")))
                return {"ok": True}
            if op == "deregister":
                return {"ok": True, "found": self.remove(str(request.get("container_id", "")))}
            if op == "list":
                entries = [dict(e.model_dump(), sockets=e.sockets()) for e in self.entries()]
                return {"ok": True, "entries": entries}
        except (ValidationError, ValueError) as exc:
            return {"ok": False, "error": f"{op}: {exc}"}
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            uid = peer_uid(sock)
            if uid not in self.allowed_uids:
                log.warning("refused a registry request from uid %d", uid)
                reply: dict[str, Any] = {"ok": False, "error": f"uid {uid} may not use the registry"}
            else:
                line = await asyncio.wait_for(reader.readline(), 10.0)
                try:
                    request = json.loads(line)
                except ValueError as exc:
                    request = None
                    reply = {"ok": False, "error": f"bad request: {exc}"}
                if isinstance(request, dict):
                    reply = self.handle(request)
                elif request is not None:
                    reply = {"ok": False, "error": "bad request: not an object"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("registry connection: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _print_table(entries: list[dict[str, Any]]) -> None:
    now = time.time()
    for e in entries:
        age = now - float(e.get("registered_at", now))
        pod = f"{e.get('namespace') or '-'}/{e.get('pod') or '-'}"
        print(
            f"{e['container_id'][:12]}  {pod}  {e.get('container') or '-'}  pid {e['pid']}  "
            f"shim {'yes' if e.get('shim') else 'NO'}  {age:.0f}s  {e.get('control_socket') or ''}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m ibckpt_node.registry"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve", "list"])
    parser.add_argument("--state-dir", default=oci.NodeConfig().state_dir)
    parser.add_argument("--allow-uid", type=int, action="append", default=[])
    parser.add_argument("--json", action="store_true", help="list: print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "list":
        path = oci.NodeConfig(state_dir=args.state_dir).registry_socket
        try:
            entries = client.list_entries(path)
        except client.RegistryError as exc:
            print(exc, file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(entries, indent=2))
        else:
            _print_table(entries)
        return 0

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with ContainerRegistry(Path(args.state_dir), [0, *args.allow_uid]) as registry:
            log.info("serving %s", registry.socket_path)
            await stop.wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
