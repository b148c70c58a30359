"""The apiserver's way to the kubelets in the guests: an HTTP CONNECT proxy on a unix socket.

The nodes' addresses (10.77.0.N, on the private link) do not exist on the host; each guest's
kubelet port is forwarded by qemu to a loopback port instead. The apiserver's egress selector
("cluster" traffic: logs, exec, port-forward) sends every connection to this proxy, which
maps a node's ip:port to its forwarded loopback port and refuses everything else.

    python -m testbed.egress --socket PATH --map 10.77.0.1:10250=127.0.0.1:41234 ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import socketserver
import sys
import threading
from collections.abc import Sequence
from typing import ClassVar

MAX_HEADER = 8192


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class _Handler(socketserver.BaseRequestHandler):
    routes: ClassVar[dict[str, tuple[str, int]]] = {}

    def handle(self) -> None:
        client: socket.socket = self.request
        head = b""
        while b"\r\n\r\n" not in head and len(head) < MAX_HEADER:
            chunk = client.recv(1024)
            if not chunk:
                return
            head += chunk
        request, _, rest = head.partition(b"\r\n\r\n")
        parts = request.split(b"\r\n", 1)[0].decode(errors="replace").split()
        target = parts[1] if len(parts) == 3 and parts[0] == "CONNECT" else ""
        route = self.routes.get(target)
        if route is None:
            client.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\n")
            return
        try:
            upstream = socket.create_connection(route, timeout=10)
        except OSError:
            client.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return
        upstream.settimeout(None)
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            upstream.sendall(rest)
        back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        back.start()
        _pipe(client, upstream)
        back.join()
        upstream.close()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.egress")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--map", action="append", default=[], help="NODE_IP:PORT=127.0.0.1:PORT")
    args = parser.parse_args(argv)
    routes = {}
    for item in args.map:
        node, _, local = item.partition("=")
        host, _, port = local.rpartition(":")
        if host != "127.0.0.1":
            parser.error(f"--map {item}: forwards go to 127.0.0.1 only")
        routes[node] = (host, int(port))
    _Handler.routes = routes
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    old = os.umask(0o077)
    server = _Server(args.socket, _Handler)
    os.umask(old)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
