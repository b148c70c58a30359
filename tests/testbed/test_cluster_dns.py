"""The testbed's cluster DNS against the real apiserver (host control plane), queried over UDP and TCP
on 127.0.0.1 with queries built as RFC 1035 lays them out."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed import cluster_dns
from testbed.kube import ControlPlane
from testbed.ports import free_port

DOMAIN = "cluster.local"


def query(name: str, qtype: int = cluster_dns.TYPE_A, ident: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def reply_of(reply: bytes, ident: int = 0x1234) -> tuple[int, list[str]]:
    """The reply's rcode and A addresses (answers follow the echoed question)."""
    got, flags, qd, an = struct.unpack("!HHHH", reply[:8])
    assert got == ident and flags & 0x8000 and qd == 1
    at = reply.index(b"\0", 12) + 5
    addresses = []
    for _ in range(an):
        pointer, rtype, rclass, ttl, size = struct.unpack("!HHHIH", reply[at : at + 12])
        assert pointer == 0xC00C and (rtype, rclass, size) == (1, 1, 4) and ttl > 0
        addresses.append(socket.inet_ntoa(reply[at + 12 : at + 16]))
        at += 16
    return flags & 0xF, addresses


def ask_udp(port: int, packet: bytes) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(10)
        sock.sendto(packet, ("127.0.0.1", port))
        return sock.recv(4096)


def ask_tcp(port: int, packet: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(struct.pack("!H", len(packet)) + packet)
        size = struct.unpack("!H", sock.recv(2))[0]
        data = b""
        while len(data) < size:
            data += sock.recv(size - len(data))
        return data


@pytest.fixture
def dns(kube: ControlPlane, tmp_path: Path) -> Iterator[int]:
    token = tmp_path / "token"
    token.write_text(kube.token)
    api = cluster_dns.ApiServer(kube.url, str(token), str(kube.ca_file))
    api.start()
    port = free_port()
    servers = cluster_dns.serve("127.0.0.1", port, lambda name: api.lookup(name, DOMAIN), DOMAIN)
    try:
        yield port
    finally:
        api.stop()
        for server in servers:
            server.shutdown()
            server.server_close()


def test_services_resolve_as_a_pods_resolver_asks_and_other_names_do_not(kube_api, dns: int) -> None:  # type: ignore[no-untyped-def]
    import kubernetes

    core: Any = kubernetes.client.CoreV1Api(kube_api)  # plain dicts as bodies
    ns = "dns-test"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        # a headless Service without a selector, its Endpoints written by hand (an S3 outside the cluster)
        core.create_namespaced_service(
            ns, {"metadata": {"name": "s3"}, "spec": {"clusterIP": "None", "ports": [{"port": 8333}]}}
        )
        core.create_namespaced_endpoints(
            ns,
            {
                "metadata": {"name": "s3"},
                "subsets": [{"addresses": [{"ip": "10.0.2.100"}], "ports": [{"port": 8333}]}],
            },
        )
        core.create_namespaced_service(ns, {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}})
        web_ip = core.read_namespaced_service("web", ns).spec.cluster_ip
        # listed at the start, before these existed: a name not in the list lists again at once, long
        # before the next 30 s listing
        deadline = time.monotonic() + 5
        while reply_of(ask_udp(dns, query(f"web.{ns}.svc.{DOMAIN}")))[0] != 0 and time.monotonic() < deadline:
            time.sleep(0.2)

        assert reply_of(ask_udp(dns, query(f"s3.{ns}.svc.{DOMAIN}"))) == (0, ["10.0.2.100"])
        assert reply_of(ask_tcp(dns, query(f"S3.{ns.upper()}.svc.{DOMAIN}"))) == (0, ["10.0.2.100"])
        assert reply_of(ask_udp(dns, query(f"web.{ns}.svc.{DOMAIN}"))) == (0, [web_ip])
        # AAAA of a known name: no error, no address (getaddrinfo then keeps the A answer)
        assert reply_of(ask_udp(dns, query(f"s3.{ns}.svc.{DOMAIN}", qtype=28))) == (0, [])
        # the search list's tries: names of the zone that name no Service do not exist
        assert reply_of(ask_udp(dns, query(f"s3.svc.{DOMAIN}"))) == (cluster_dns.NXDOMAIN, [])
        assert reply_of(ask_udp(dns, query(f"nothing.{ns}.svc.{DOMAIN}"))) == (cluster_dns.NXDOMAIN, [])
        # outside the zone: no such name either (REFUSED would end a resolver's search list there)
        assert reply_of(ask_udp(dns, query("s3.example.com"))) == (cluster_dns.NXDOMAIN, [])
        # a malformed question: an error reply, not silence
        ident, flags = struct.unpack("!HH", ask_udp(dns, query(f"s3.{ns}.svc.{DOMAIN}")[:20])[:4])
        assert ident == 0x1234 and flags & 0x8000 and flags & 0xF == cluster_dns.FORMERR
    finally:
        core.delete_namespace(ns)
