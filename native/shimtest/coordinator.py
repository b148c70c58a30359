"""A small local coordinator for libibckpt: a key-value store with blocking get.

Wire format (text lines; a connection may carry several requests, answered in order):
    PUT <key> <value...>        -> OK
    GET <key> <timeout_ms>      -> VAL <value...> | NONE
It is what the operator's coordinator provides for a whole job; this one serves
the processes of one machine (tests, single-node runs).
"""

from __future__ import annotations

import os
import socketserver
import threading
from pathlib import Path


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cond = threading.Condition()

    def put(self, key: str, value: str) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout_s: float) -> str | None:
        with self.cond:
            self.cond.wait_for(lambda: key in self.data, timeout=timeout_s)
            return self.data.get(key)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server | _TcpServer

    def handle(self) -> None:
        while raw := self.rfile.readline():
            self.wfile.write(self.answer(raw.decode().rstrip("\n")))

    def answer(self, line: str) -> bytes:
        verb, _, rest = line.partition(" ")
        store = self.server.store
        if verb == "PUT":
            key, _, value = rest.partition(" ")
            store.put(key, value)
            return b"OK\n"
        if verb == "GET":
            key, _, timeout = rest.partition(" ")
            found = store.get(key, max(int(timeout or "0"), 0) / 1000.0)
            return b"NONE\n" if found is None else f"VAL {found}\n".encode()
        return b"ERR\n"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    store: _Store


class _TcpServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: _Store


def serve_tcp(bind: str, port: int) -> None:
    """Serve over TCP in the foreground: for ranks on several hosts with no node agent (tests/mpi)."""
    server = _TcpServer((bind, port), _Handler)
    server.store = _Store()
    print(f"ibckpt_native.coordinator: serving on {bind}:{port}", flush=True)
    server.serve_forever()


class Coordinator:
    """Serve on a unix socket in a background thread; `env` is what the shim needs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.exists():
            path.unlink()
        self._server = _Server(str(path), _Handler)
        self._server.store = _Store()
        os.chmod(path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def env(self) -> dict[str, str]:
        return {"IBCKPT_COORD": f"unix:{self.path}"}

    def keys(self) -> list[str]:
        with self._server.store.cond:
            return sorted(self._server.store.data)

    def __enter__(self) -> Coordinator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.path.exists():
            self.path.unlink()
