"""The container registry's wire protocol (version 1) and its client, as the hook uses it.

One request per connection on the agent's unix socket: a JSON object on one line, answered by
one JSON line.

    {"v": 1, "op": "register", "entry": {...}}        -> {"ok": true}
    {"v": 1, "op": "deregister", "container_id": ID}  -> {"ok": true, "found": bool}
    {"v": 1, "op": "list"}                            -> {"ok": true, "entries": [...]}
    any failure                                       -> {"ok": false, "error": "..."}

An entry: container_id, namespace, pod, pod_uid, container, pid, pid_start (the process's start
time in clock ticks, so a reused pid is not mistaken for it), control_dir (host path where the
shim makes `<pid>.sock`), control_socket (the socket the container's first process will make),
shim (whether the shim is preloaded), reason, registered_at (unix time).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket

PROTO_VERSION = 1
MAX_LINE = 4 * 1024 * 1024  # a list reply carries every container on the node

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class RegistryError(Exception):
    pass


def request(path: str, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request, bounded by timeout_s in total (connect, send and reply)."""
    body = dict(message)
    body["v"] = PROTO_VERSION
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        # the registry answers a refused uid before it reads, and closes: its reply is still queued
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(json.dumps(body, separators=(",", ":")).encode() + b"\n")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if chunk.endswith(b"\n") or size > MAX_LINE:
                break
    except OSError as exc:
        raise RegistryError(f"registry {path}: {exc.strerror or exc}") from exc
    finally:
        sock.close()
    raw = b"".join(chunks)
    if not raw.endswith(b"\n"):
        raise RegistryError(f"registry {path}: no complete reply")
    try:
        reply = json.loads(raw)
    except ValueError as exc:
        raise RegistryError(f"registry {path}: bad reply: {exc}") from exc
    if not isinstance(reply, dict):
        raise RegistryError(f"registry {path}: bad reply")
    if not reply.get("ok"):
        raise RegistryError(f"registry {path}: {reply.get('error', 'refused')}")
    return reply


def register(path: str, entry: dict[str, Any], timeout_s: float) -> None:
    request(path, {"op": "register", "entry": entry}, timeout_s)


def deregister(path: str, container_id: str, timeout_s: float) -> bool:
    return bool(request(path, {"op": "deregister", "container_id": container_id}, timeout_s).get("found"))


def list_entries(path: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    entries = request(path, {"op": "list"}, timeout_s).get("entries")
    if not isinstance(entries, list):
        raise RegistryError(f"registry {path}: bad list reply")
    return entries


def process_start(pid: int) -> int:
    """Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    # comm may hold spaces and parentheses: fields resume after the last ')'
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])


def inner_pid(pid: int) -> int:
    """The pid as the process sees it in its own pid namespace (last NSpid field)."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def write_json_atomic(path: str, value: object, mode: int = 0o600) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(value, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
