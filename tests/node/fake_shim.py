"""A stand-in for a rank's shim control socket, for host tests of the node driver.

It speaks the control protocol's framing (one request line, one `ok|err <json>` reply line) and
records every verb it was sent. Subclasses decide the replies in `answer`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

from ibckpt_native.control import STATE_AFTER


class FakeShimSocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = "running"
        self.commands: list[str] = []
        self.lines: list[str] = []  # the whole request lines, arguments included
        self.leases: list[str] = []  # `lease` lines, which come on a timer
        self.raw_replies: dict[str, str] = {}  # verb -> the line sent instead of a well-formed reply
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        """Every phase succeeds and moves the state the way the real shim does."""
        self.state = STATE_AFTER.get(verb, self.state)
        return True, {"phase": verb, "ok": True, "ms": 0, "state": self.state}

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            # One thread per connection: the driver talks to many ranks at once and a reply may wait.
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            line = conn.makefile().readline().strip()
            if not line:  # a probe (is anyone listening?) that sent nothing, as the agent's
                return
            verb = line.split()[0]
            if verb == "lease":  # renewals come on a timer: kept apart from the phases
                self.leases.append(line)
                ok, reply = True, {"phase": "lease", "ok": True, "ms": 0, "state": self.state}
                with contextlib.suppress(BrokenPipeError):
                    conn.sendall(f"ok {json.dumps(reply)}\n".encode())
                return
            self.lines.append(line)
            self.commands.append(verb)
            try:
                ok, reply = self.answer(verb)
            except ConnectionAbortedError:  # a rank that dies here closes its connection with no answer
                return
            line = self.raw_replies.get(verb) or f"{'ok' if ok else 'err'} {json.dumps(reply)}"
            with contextlib.suppress(BrokenPipeError):  # the driver gave up waiting, as a real shim sees
                conn.sendall(f"{line}\n".encode())
