"""The testbed's cluster DNS: the part CoreDNS (its kubernetes plugin) plays on a real cluster, spoken
over DNS's own wire (RFC 1035, UDP and TCP) to the resolvers of the nodes' pods.

It answers A queries for `SERVICE.NAMESPACE.svc.DOMAIN` from the apiserver: a Service's cluster IP, or
for a headless one (clusterIP None) the addresses of its Endpoints. Any other name gets NXDOMAIN: the
testbed has no upstream, and glibc ends a search list at a REFUSED (a pod's search domains are tried
before the name itself, ndots 5) where it goes on after NXDOMAIN. Other query types of a known name get
an empty answer. The kubelets point pods at it (clusterDNS: the node's address),
so an agent with `dnsPolicy: ClusterFirstWithHostNet` resolves an in-cluster S3 Service's name as it
would on a real cluster.

Standalone on purpose, as rdma_device_plugin.py: it runs in the testbed's apps image from a ConfigMap and
imports only the standard library.

    python3 cluster_dns.py --address ADDR [--port 53] [--domain cluster.local]
        [--api URL --token-file F --ca-file F]   (default: the pod's service account)
"""

from __future__ import annotations

import argparse
import json
import os
import socketserver
import ssl
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TTL_S = 5
TYPE_A = 1
CLASS_IN = 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 1, 2, 3, 4
API_TIMEOUT_S = 5.0
REFRESH_S = 30.0  # idle: a listing costs the emulated node's CPU
MISS_REFRESH_S = 1.0  # a name not listed lists again, at most this often

# what a lookup gives: None when the name does not exist, else the IPv4 addresses it has (maybe none)
Lookup = Callable[[str], "list[str] | None"]


class Query:
    """The one question of a query, and what the answer must repeat of it."""

    def __init__(self, ident: int, flags: int, name: str, qtype: int, qclass: int, question: bytes) -> None:
        self.ident, self.flags, self.name, self.qtype, self.qclass = ident, flags, name, qtype, qclass
        self.question = question  # the question's bytes as sent, echoed in the answer


def parse(packet: bytes) -> Query | int | None:
    """The query in packet; an rcode for one that can be answered only with an error; None when not even
    its id can be read."""
    if len(packet) < 12:
        return None
    ident, flags, qdcount = (int(v) for v in struct.unpack("!HHH", packet[:6]))
    if flags & 0x8000:
        return None  # a response: never answer one
    if (flags >> 11) & 0xF != 0:
        return NOTIMP << 16 | ident
    if qdcount != 1:
        return FORMERR << 16 | ident
    labels: list[str] = []
    at = 12
    while True:
        if at >= len(packet):
            return FORMERR << 16 | ident
        size = packet[at]
        at += 1
        if size == 0:
            break
        if size & 0xC0 or at + size > len(packet):
            return FORMERR << 16 | ident  # no compression in a question we accept
        labels.append(packet[at : at + size].decode("ascii", "replace").lower())
        at += size
    if at + 4 > len(packet):
        return FORMERR << 16 | ident
    qtype, qclass = (int(v) for v in struct.unpack("!HH", packet[at : at + 4]))
    return Query(ident, flags, ".".join(labels), qtype, qclass, packet[12 : at + 4])


def error_reply(ident: int, rcode: int) -> bytes:
    return struct.pack("!HHHHHH", ident, 0x8000 | rcode, 0, 0, 0, 0)


def answer(packet: bytes, lookup: Lookup, domain: str) -> bytes | None:
    """The reply to one query packet (None: none is due)."""
    query = parse(packet)
    if query is None:
        return None
    if isinstance(query, int):
        return error_reply(query & 0xFFFF, query >> 16)
    recursion_desired = query.flags & 0x0100
    in_zone = query.name == domain or query.name.endswith("." + domain)
    addresses: list[str] = []
    if not in_zone:
        rcode = NXDOMAIN  # what CoreDNS's upstream would say of a name nobody has
    else:
        found = lookup(query.name)
        rcode, addresses = (NXDOMAIN, []) if found is None else (NOERROR, found)
    if query.qtype != TYPE_A or query.qclass != CLASS_IN:
        addresses = []
    flags = 0x8000 | (0x0400 if in_zone else 0) | recursion_desired | rcode
    out = [struct.pack("!HHHHHH", query.ident, flags, 1, len(addresses), 0, 0), query.question]
    for address in addresses:
        # the name: a pointer to the question's (offset 12)
        out.append(struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4))
        out.append(bytes(int(part) for part in address.split(".")))
    return b"".join(out)


class ApiServer:
    """Every Service and Endpoints of the cluster, listed again every REFRESH_S seconds in a thread of its
    own (as CoreDNS keeps its informers' caches), and at once when a Service name is not in the list: a
    query is answered from memory. Asking the apiserver
    per query took longer than the resolver's 5 s on the emulated nodes, and lookups failed."""

    def __init__(self, url: str, token_file: str, ca_file: str) -> None:
        self.url = url.rstrip("/")
        self.token_file = token_file
        self.context = ssl.create_default_context(cafile=ca_file)
        self._records: dict[tuple[str, str], list[str]] = {}  # (namespace, service) -> addresses
        self._listed = threading.Event()
        self._stopped = threading.Event()
        self._refreshing = threading.Lock()
        self._listed_at = 0.0

    def get(self, path: str) -> Any:
        with open(self.token_file) as f:
            token = f.read().strip()  # the kubelet rotates it: read it every time
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=API_TIMEOUT_S, context=self.context) as reply:
            return json.load(reply)

    def refresh(self, unless_since: float | None = None) -> None:
        """List Services and Endpoints once and replace the records; not again if a listing that started
        after `unless_since` ended meanwhile (the A and AAAA queries of one lookup miss together)."""
        with self._refreshing:
            if unless_since is None or self._listed_at < unless_since:
                self._refresh()

    def _refresh(self) -> None:
        started = time.monotonic()
        services = self.get("/api/v1/services")["items"]
        endpoints = {
            (e["metadata"]["namespace"], e["metadata"]["name"]): e
            for e in self.get("/api/v1/endpoints")["items"]
        }
        records: dict[tuple[str, str], list[str]] = {}
        for service in services:
            key = (service["metadata"]["namespace"], service["metadata"]["name"])
            cluster_ip = (service.get("spec") or {}).get("clusterIP")
            if cluster_ip and cluster_ip != "None":
                records[key] = [str(cluster_ip)]
                continue
            subsets = (endpoints.get(key) or {}).get("subsets") or []
            records[key] = [a["ip"] for subset in subsets for a in subset.get("addresses") or []]
        self._records = records  # one assignment: a query sees the old records or the new ones
        self._listed_at = started
        self._listed.set()

    def keep_listing(self) -> None:
        """refresh() every REFRESH_S until stop(); a failure is said and retried."""
        while not self._stopped.is_set():
            try:
                self.refresh()
            except Exception as error:
                print(f"cluster-dns: listing Services and Endpoints: {error}", file=sys.stderr, flush=True)
            self._stopped.wait(REFRESH_S)

    def start(self) -> None:
        threading.Thread(target=self.keep_listing, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def lookup(self, name: str, domain: str) -> list[str] | None:
        labels = name.split(".")
        zone = ["svc", *domain.split(".")]
        if len(labels) != len(zone) + 2 or labels[2:] != zone:
            return None
        if not self._listed.wait(API_TIMEOUT_S):
            raise RuntimeError("no list of the Services yet")  # SERVFAIL: the resolver tries again
        key = (labels[1], labels[0])
        asked = time.monotonic()
        if key not in self._records and asked - self._listed_at > MISS_REFRESH_S:
            self.refresh(unless_since=asked - MISS_REFRESH_S)  # a Service made since the last listing
        return self._records.get(key)


def serve(address: str, port: int, lookup: Lookup, domain: str) -> tuple[socketserver.BaseServer, ...]:
    """UDP and TCP servers on address:port, each in a thread of its own; returns them (shutdown() stops)."""

    def reply_to(packet: bytes) -> bytes | None:
        try:
            return answer(packet, lookup, domain)
        except Exception as error:  # the apiserver unreachable, say: SERVFAIL, and say why in the log
            print(f"cluster-dns: {error}", file=sys.stderr, flush=True)
            query = parse(packet)
            return error_reply(query.ident, SERVFAIL) if isinstance(query, Query) else None

    class Udp(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            packet, sock = self.request
            reply = reply_to(packet)
            if reply is not None:
                sock.sendto(reply, self.client_address)

    class Tcp(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while True:
                head = self.rfile.read(2)
                if len(head) < 2:
                    return
                reply = reply_to(self.rfile.read(struct.unpack("!H", head)[0]))
                if reply is None:
                    return
                self.wfile.write(struct.pack("!H", len(reply)) + reply)

    class UdpServer(socketserver.ThreadingUDPServer):
        daemon_threads = True

    class TcpServer(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    servers = (UdpServer((address, port), Udp), TcpServer((address, port), Tcp))
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("NODE_IP", ""))
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--domain", default="cluster.local")
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    parser.add_argument("--api", default=f"https://{host}:{port}")
    parser.add_argument("--token-file", default=f"{ACCOUNT}/token")
    parser.add_argument("--ca-file", default=f"{ACCOUNT}/ca.crt")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("give --address (or $NODE_IP)")
    api = ApiServer(args.api, args.token_file, args.ca_file)
    api.start()
    domain = args.domain.lower().strip(".")
    serve(args.address, args.port, lambda name: api.lookup(name, domain), domain)
    print(f"cluster-dns: serving {domain} on {args.address}:{args.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
