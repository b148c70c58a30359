"""A minimal remote-exec service for the two test guests, so that mpirun can start orted on the peer.

The guests have no sshd. Open MPI's rsh launcher runs `AGENT [options] HOST COMMAND...` and expects
the agent to run COMMAND through a shell on HOST, relay its output and end when it ends. This file is
both halves, stdlib only (it runs in a slow TCG guest):

  python3 rexec.py serve [--bind ADDR] [--port N]  # in the peer guest; serves until a `--quit` request
  python3 rexec.py [-x ...] HOST COMMAND...         # the agent (mpirun --mca plm_rsh_agent)
  python3 rexec.py --quit HOST                      # stops the peer's server

Protocol over one TCP connection: the client sends one JSON line {"command": str} (or {"quit": true});
the server answers with frames `<kind:1 byte><length:4 bytes big-endian><data>`: b"o" stdout,
b"e" stderr, b"x" the exit status as text (last frame). When the client goes away, the server kills
the command's process group. The listener is meant for the guests' private link only: it runs
whatever it is sent, so never bind it to an address reachable from elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import BinaryIO

DEFAULT_PORT = int(os.environ.get("IBCKPT_REXEC_PORT", "7207"))
_HEADER = struct.Struct(">cI")


def _send_frame(sock: socket.socket, lock: threading.Lock, kind: bytes, data: bytes) -> None:
    with lock:
        sock.sendall(_HEADER.pack(kind, len(data)) + data)


def _pump(stream: BinaryIO, sock: socket.socket, lock: threading.Lock, kind: bytes) -> None:
    try:
        while chunk := stream.read1(65536):
            _send_frame(sock, lock, kind, chunk)
    except OSError:
        pass


def _handle(conn: socket.socket, stop: threading.Event) -> None:
    with conn:
        request = json.loads(conn.makefile("rb").readline())
        lock = threading.Lock()
        if request.get("quit"):
            stop.set()
            _send_frame(conn, lock, b"x", b"0")
            return
        proc = subprocess.Popen(
            ["/bin/sh", "-c", request["command"]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, conn, lock, b"o"), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, conn, lock, b"e"), daemon=True),
        ]
        for t in pumps:
            t.start()

        def watch_client() -> None:
            # The client never sends after its request: EOF or an error means it is gone.
            with contextlib.suppress(OSError):
                conn.recv(1)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        threading.Thread(target=watch_client, daemon=True).start()
        rc = proc.wait()
        for t in pumps:
            t.join(5)
        with contextlib.suppress(OSError):
            _send_frame(conn, lock, b"x", str(rc).encode())


def serve(bind: str, port: int) -> int:
    stop = threading.Event()
    with socket.create_server((bind, port), reuse_port=False) as listener:
        listener.settimeout(0.5)
        print(f"rexec: serving on {bind}:{port}", flush=True)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=_handle, args=(conn, stop), daemon=True).start()
    return 0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("rexec: connection closed early")
        buf += chunk
    return buf


def request(host: str, port: int, payload: dict[str, object]) -> int:
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.settimeout(None)
        sock.sendall(json.dumps(payload).encode() + b"\n")
        while True:
            kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
            data = _recv_exact(sock, length)
            if kind == b"o":
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            elif kind == b"e":
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()
            else:
                return int(data)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if args[:1] == ["serve"]:
        bind, port = "127.0.0.1", DEFAULT_PORT  # tests pass --bind with the private link address
        rest = args[1:]
        while rest:
            opt, value, *rest = rest
            if opt == "--bind":
                bind = value
            elif opt == "--port":
                port = int(value)
            else:
                raise SystemExit(f"rexec: unknown option {opt}")
        return serve(bind, port)
    if args[:1] == ["--quit"]:
        return request(args[1], DEFAULT_PORT, {"quit": True})
    # Agent mode: skip ssh-style options (Open MPI may pass e.g. -x) up to the host.
    while args and args[0].startswith("-"):
        args.pop(0)
    if len(args) < 2:
        raise SystemExit("usage: rexec.py HOST COMMAND... | rexec.py serve | rexec.py --quit HOST")
    host, command = args[0], " ".join(args[1:])
    return request(host, DEFAULT_PORT, {"command": command})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
