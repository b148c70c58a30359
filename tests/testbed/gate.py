"""A TCP relay on 127.0.0.1 that a test can cut and mend: a network fault between the nodes and a host
service (S3) at a moment the test picks. Cut, it resets every relayed connection and every new one at
once, as a dead link or a crashed server would; stalled, it holds every byte (connections stay open, as
with a server that hangs), so a request in flight waits for as long as the test likes. Its port stays the
same, so a cluster booted with the port forwarded keeps reaching it."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time


def _abort_on_close(sock: socket.socket) -> None:
    """Make the next close send an RST, not a FIN: the peer sees 'connection reset', not a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _reset(sock: socket.socket) -> None:
    _abort_on_close(sock)
    sock.close()


class Gate:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open = True
        self._stalled = False
        self._live: set[socket.socket] = set()
        self.refused = 0  # connections reset while cut, for the test's report
        threading.Thread(target=self._accept, name=f"gate-{self.port}", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._open = False
            live, self._live = self._live, set()
            # Under the lock, so that a relay thread that sees the cut and closes first also resets.
            for sock in live:
                _abort_on_close(sock)
        for sock in live:
            sock.close()

    def stall(self) -> None:
        with self._lock:
            self._stalled = True

    def mend(self) -> None:
        with self._lock:
            self._open = True
            self._stalled = False

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if not self._open:
                    self.refused += 1
                    _reset(client)
                    continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._live.update((client, server))
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        with selectors.DefaultSelector() as selector:
            for sock in peer:
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            try:
                while True:
                    if self._stalled:
                        time.sleep(0.1)
                    for key, _ in [] if self._stalled else selector.select(timeout=1.0):
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                        if not data:
                            return
                        peer[key.fileobj].setblocking(True)  # type: ignore[index]
                        peer[key.fileobj].sendall(data)  # type: ignore[index]
                        peer[key.fileobj].setblocking(False)  # type: ignore[index]
                    with self._lock:
                        if client not in self._live:
                            return  # cut
            except OSError:
                return  # reset by a cut, or by either end
            finally:
                with self._lock:
                    self._live.discard(client)
                    self._live.discard(server)
                for sock in peer:
                    sock.close()
