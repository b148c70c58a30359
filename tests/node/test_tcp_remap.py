"""Address remapping of TCP sockets in CRIU images (host: real `crit`, a hand-made files.img)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ibckpt_node import tcp_remap

A, B = "10.77.0.1", "10.77.0.2"
SWAP = tcp_remap.parse_map([f"{A}={B}", f"{B}={A}"])


def _isk(ino: int, family: int, src: str, dst: str, sport: int, dport: int, state: int) -> dict[str, Any]:
    return {
        "id": ino, "ino": ino, "family": family, "type": 1, "proto": 6, "state": state,
        "src_port": sport, "dst_port": dport, "flags": 2, "backlog": 0,
        "src_addr": tcp_remap.addr_to_words(ipaddress.ip_address(src)),
        "dst_addr": tcp_remap.addr_to_words(ipaddress.ip_address(dst)),
        "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
        "opts": {"so_sndbuf": 16384, "so_rcvbuf": 131072, "so_snd_tmo_sec": 0, "so_snd_tmo_usec": 0,
                 "so_rcv_tmo_sec": 0, "so_rcv_tmo_usec": 0},
    }  # fmt: skip


def _files_img(images: Path, sockets: list[dict[str, Any]]) -> None:
    images.mkdir(parents=True, exist_ok=True)
    doc = {"magic": "FILES", "entries": [{"type": "INETSK", "id": s["id"], "isk": s} for s in sockets]}
    (images / "in.json").write_text(json.dumps(doc))
    subprocess.run(
        ["crit", "encode", "-i", str(images / "in.json"), "-o", str(images / "files.img")], check=True
    )


def _addresses(images: Path) -> dict[int, tuple[str, str]]:
    decode = ["crit", "decode", "-i", str(images / "files.img"), "--pretty"]
    entries = json.loads(subprocess.run(decode, check=True, capture_output=True, text=True).stdout)["entries"]
    return {e["isk"]["ino"]: (e["isk"]["src_addr"][0], e["isk"]["dst_addr"][0]) for e in entries}


def test_words_match_criu_encoding() -> None:
    # crit prints 10.77.0.1 for the word CRIU stores (the network-order bytes read as a u32)
    assert tcp_remap.words_to_addr([16796938]) == ipaddress.IPv4Address(A)
    v6 = ipaddress.IPv6Address("fd00::1:2")
    assert tcp_remap.words_to_addr(tcp_remap.addr_to_words(v6)) == v6


def test_both_ends_of_a_swapped_connection_agree_again(tmp_path: Path) -> None:
    server, client = tmp_path / "server", tmp_path / "client"
    # rank 0 listened on A:18515 and accepted rank 1's connection from B:40000; a listener
    # bound to any address and a loopback connection stay as they are
    _files_img(server, [
        _isk(11, 2, A, B, 18515, 40000, 1),
        _isk(12, 2, "0.0.0.0", "0.0.0.0", 18516, 0, 10),
        _isk(13, 2, "127.0.0.1", "127.0.0.1", 5000, 5001, 1),
    ])  # fmt: skip
    _files_img(client, [_isk(21, 10, f"::ffff:{B}", f"::ffff:{A}", 40000, 18515, 1)])
    changes = tcp_remap.remap_images(server, SWAP) + tcp_remap.remap_images(client, SWAP)
    assert len(changes) == 2, changes
    srv, cli = _addresses(server), _addresses(client)
    assert srv[11] == (B, A) and srv[12] == ("0.0.0.0", "0.0.0.0") and srv[13] == ("127.0.0.1", "127.0.0.1")
    # the dual-stack socket stays IPv4-mapped, the mapped addresses swapped: rank 0, now on B,
    # and rank 1, now on A, have 4-tuples that mirror each other again
    cli_src, cli_dst = (ipaddress.IPv6Address(a) for a in cli[21])
    assert (cli_src.ipv4_mapped, cli_dst.ipv4_mapped) == (ipaddress.IPv4Address(A), ipaddress.IPv4Address(B))
    assert (str(cli_src.ipv4_mapped), str(cli_dst.ipv4_mapped)) == (srv[11][1], srv[11][0])


def test_remapping_again_starts_from_the_dump(tmp_path: Path) -> None:
    images = tmp_path / "r"
    _files_img(images, [_isk(11, 2, A, B, 18515, 40000, 1)])
    tcp_remap.remap_images(images, SWAP)
    tcp_remap.remap_images(images, SWAP)  # a retried restore: not swapped back
    assert _addresses(images)[11] == (B, A)
    tcp_remap.remap_images(images, tcp_remap.parse_map([f"{A}=10.77.0.9"]))
    assert _addresses(images)[11] == ("10.77.0.9", B)


def test_bad_maps_are_refused() -> None:
    with pytest.raises(ValueError, match="one family"):
        tcp_remap.parse_map(["10.0.0.1=fd00::1"])
    with pytest.raises(ValueError, match="OLD=NEW"):
        tcp_remap.parse_map(["10.0.0.1"])
    with pytest.raises(ValueError, match="twice"):
        tcp_remap.parse_map(["10.0.0.1=10.0.0.2", "10.0.0.1=10.0.0.3"])


def test_established_connections_are_listed_as_restored(tmp_path: Path) -> None:
    images = tmp_path / "r"
    _files_img(images, [_isk(11, 2, A, B, 18515, 40000, 1), _isk(12, 2, "0.0.0.0", "0.0.0.0", 18516, 0, 10)])
    (images / "tcp-stream-11.img").write_bytes(b"")  # only its presence matters here
    prepared = tcp_remap.prepare_images(images, SWAP)
    assert [c.describe() for c in prepared.connections] == [f"{B}:18515 -> {A}:40000"]
    # without a map the images are left alone, but the connections are still found (to hold them)
    unmapped = tcp_remap.prepare_images(images, {})
    assert unmapped.changes == []
    assert [c.describe() for c in unmapped.connections] == [f"{A}:18515 -> {B}:40000"]
    rules = tcp_remap.ConnectionLock._rules(prepared.connections[0])
    assert [" ".join(r) for r in rules] == [
        f"iptables -w -t filter {{op}} INPUT -p tcp -s {A} --sport 40000 -d {B} --dport 18515 -j DROP",
        f"iptables -w -t filter {{op}} OUTPUT -p tcp -s {B} --sport 18515 -d {A} --dport 40000 -j DROP",
    ]
