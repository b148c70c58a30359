"""Move established TCP connections with their ranks: rewrite the addresses in CRIU images.

CRIU dumps an established TCP connection with TCP repair (`--tcp-established`): the socket's
addresses and ports go into the inet socket entry of `files.img`, its sequence numbers, windows
and queued data into `tcp-stream-<inode>.img` (no address there). On restore CRIU binds the
socket to the dumped local address and reconnects it, in repair mode, to the dumped peer. When
ranks move, both addresses are stale: the local one is not on the new node and the peer has
moved too. With the job's address map {old: new} (the same map on every node), every inet
socket entry of an image has its local and remote addresses rewritten. Both ends of a
connection are rewritten by the same map, so they agree again on the 4-tuple, and TCP's
sequence state, restored on both sides, lets the stream continue where it was cut.

Both ends are restored at different moments, and a restored socket leaving repair mode sends a
window probe at once. Were it to reach the peer node before the peer's socket is back, that node
would answer with a reset and kill the connection. On one node CRIU avoids this with the
iptables rules its dump leaves in place until the restore; across nodes the destination has no
such rules. So the agent installs them itself (`ConnectionLock`): before any node restores, each
node drops the packets of its arriving connections, in and out, and only once every node has
restored (the `restored` barrier) are the rules removed and the connections let go.

The images are decoded and encoded with CRIU's own `crit` (its JSON keeps addresses as the
raw 32-bit words of the protobuf). The original `files.img` is kept as `files.img.orig`, so
remapping the same image directory again starts from the dump, not from a previous remap.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import struct
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressMap = Mapping[IPAddress, IPAddress]

# Image files that carry inet socket entries: files.img since CRIU 3.x, inetsk.img before.
IMAGES_WITH_SOCKETS = ("files.img", "inetsk.img")
CRIT_TIMEOUT_S = 120.0
TCP_ESTABLISHED = 1


class RemapError(RuntimeError):
    pass


def parse_map(specs: Sequence[str]) -> dict[IPAddress, IPAddress]:
    """`OLD=NEW` pairs (IPv4 or IPv6, the two of one family) as an address map."""
    amap: dict[IPAddress, IPAddress] = {}
    for spec in specs:
        old, sep, new = spec.partition("=")
        try:
            a, b = ipaddress.ip_address(old.strip()), ipaddress.ip_address(new.strip())
        except ValueError:
            raise ValueError(f"--remap-ip {spec!r}: expected OLD=NEW addresses") from None
        if not sep or a.version != b.version:
            raise ValueError(f"--remap-ip {spec!r}: expected OLD=NEW addresses of one family")
        if a in amap and amap[a] != b:
            raise ValueError(f"--remap-ip: {a} is mapped twice")
        amap[a] = b
    return amap


def words_to_addr(words: Sequence[int]) -> IPAddress:
    """CRIU stores an address as the in-memory 32-bit words of the network-order bytes."""
    raw = b"".join(struct.pack("<I", w) for w in words)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    raise RemapError(f"an address of {len(words)} words")


def addr_to_words(addr: IPAddress) -> list[int]:
    raw = addr.packed
    return [struct.unpack("<I", raw[i : i + 4])[0] for i in range(0, len(raw), 4)]


def _map_one(addr: IPAddress, amap: AddressMap) -> IPAddress:
    if addr in amap:
        return amap[addr]
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        v4 = addr.ipv4_mapped
        if v4 in amap:  # a dual-stack socket: keep it IPv4-mapped
            return ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + amap[v4].packed)
    return addr


def remap_socket(entry: dict[str, Any], amap: AddressMap) -> list[str]:
    """Rewrite one inet socket entry (crit's raw JSON) in place; describe what changed."""
    if entry.get("family") not in (socket.AF_INET, socket.AF_INET6):
        return []
    changes = []
    for name in ("src_addr", "dst_addr"):
        words = entry.get(name)
        if not words:
            continue
        old = words_to_addr(words)
        new = _map_one(old, amap)
        if new != old:
            if len(new.packed) != len(old.packed):
                raise RemapError(f"cannot map {old} to {new}: another address family")
            entry[name] = addr_to_words(new)
            changes.append(f"{name} {old} -> {new}")
    if changes:
        ports = f"{entry.get('src_port', 0)}->{entry.get('dst_port', 0)}"
        return [f"socket ino {entry.get('ino')} ({ports}): " + ", ".join(changes)]
    return []


def remap_document(doc: dict[str, Any], amap: AddressMap) -> list[str]:
    """Rewrite every inet socket of a decoded files.img (or inetsk.img) document."""
    changes = []
    for entry in doc.get("entries", []):
        if "isk" in entry:  # files.img: a file entry wrapping an inet socket
            changes += remap_socket(entry["isk"], amap)
        elif "src_addr" in entry or "family" in entry:  # inetsk.img: the socket entries themselves
            changes += remap_socket(entry, amap)
    return changes


def _crit() -> str:
    found = shutil.which("crit")
    if not found:
        raise RemapError("CRIU's crit is not installed on this node")
    return found


def _run(args: list[str]) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=CRIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RemapError(f"{' '.join(args)} timed out") from None
    if proc.returncode != 0:
        raise RemapError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}")
    return proc.stdout


@dataclass(frozen=True)
class Connection:
    """An established TCP connection as a restored socket will have it."""

    local: IPAddress
    local_port: int
    remote: IPAddress
    remote_port: int

    def describe(self) -> str:
        return f"{self.local}:{self.local_port} -> {self.remote}:{self.remote_port}"


def established(doc: dict[str, Any]) -> list[Connection]:
    """The established TCP connections of a decoded files.img (or inetsk.img) document."""
    found = []
    for entry in doc.get("entries", []):
        isk = entry.get("isk", entry)
        if isk.get("proto") != socket.IPPROTO_TCP or isk.get("state") != TCP_ESTABLISHED:
            continue
        if not isk.get("src_addr") or not isk.get("dst_addr"):
            continue
        found.append(
            Connection(
                words_to_addr(isk["src_addr"]),
                int(isk.get("src_port", 0)),
                words_to_addr(isk["dst_addr"]),
                int(isk.get("dst_port", 0)),
            )
        )
    return found


@dataclass
class Prepared:
    changes: list[str] = field(default_factory=list)  # addresses rewritten
    connections: list[Connection] = field(default_factory=list)  # established, as they will be restored


def prepare_images(images: Path, amap: AddressMap) -> Prepared:
    """Rewrite the socket addresses of one CRIU image directory by `amap` (may be empty) and list
    the established TCP connections it will restore. Without TCP stream images (no established
    connection was dumped) and without a map, nothing is decoded."""
    result = Prepared()
    if not amap and not any(images.glob("tcp-stream-*.img")):
        return result
    for name in IMAGES_WITH_SOCKETS:
        image = images / name
        original = images / f"{name}.orig"
        if not image.exists():
            continue
        if not original.exists():
            shutil.copy2(image, original)
        doc = json.loads(_run([_crit(), "decode", "-i", str(original)]))
        done = remap_document(doc, amap)
        result.connections += established(doc)
        if not done:
            shutil.copy2(original, image)
            continue
        decoded = images / f"{name}.remapped.json"
        decoded.write_text(json.dumps(doc))
        tmp = images / f"{name}.tmp"
        _run([_crit(), "encode", "-i", str(decoded), "-o", str(tmp)])
        tmp.replace(image)
        result.changes += [f"{name}: {c}" for c in done]
    return result


def remap_images(images: Path, amap: AddressMap) -> list[str]:
    """Rewrite the socket addresses of one CRIU image directory; returns what changed."""
    return prepare_images(images, amap).changes if amap else []


class ConnectionLock:
    """iptables rules that drop the packets of some TCP connections, both ways, on this node."""

    def __init__(self, connections: Sequence[Connection]) -> None:
        self.connections = list(dict.fromkeys(connections))
        self.installed: list[list[str]] = []

    @staticmethod
    def _rules(c: Connection) -> list[list[str]]:
        tool = "iptables" if c.local.version == 4 else "ip6tables"
        head = [tool, "-w", "-t", "filter", "{op}"]
        inbound = ["-s", str(c.remote), "--sport", str(c.remote_port), "-d", str(c.local)]
        outbound = ["-s", str(c.local), "--sport", str(c.local_port), "-d", str(c.remote)]
        return [
            [*head, "INPUT", "-p", "tcp", *inbound, "--dport", str(c.local_port), "-j", "DROP"],
            [*head, "OUTPUT", "-p", "tcp", *outbound, "--dport", str(c.remote_port), "-j", "DROP"],
        ]

    def lock(self) -> None:
        for c in self.connections:
            for rule in self._rules(c):
                _run([("-I" if a == "{op}" else a) for a in rule])
                self.installed.append(rule)

    def extend(self, connections: Sequence[Connection]) -> None:
        """Lock these connections too (those already held are not locked twice)."""
        new = [c for c in dict.fromkeys(connections) if c not in self.connections]
        self.connections += new
        for c in new:
            for rule in self._rules(c):
                _run([("-I" if a == "{op}" else a) for a in rule])
                self.installed.append(rule)

    def unlock(self) -> list[str]:
        """Remove every installed rule; returns the errors (a rule that could not be removed)."""
        errors = []
        while self.installed:
            rule = self.installed.pop()
            try:
                _run([("-D" if a == "{op}" else a) for a in rule])
            except RemapError as exc:
                errors.append(str(exc))
        return errors
