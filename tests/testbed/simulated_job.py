"""A simulated job for the coordinator: N nodes x R ranks per node, all-to-all QPs.

Used by the scale test (tests/coordination) and bench/coordinator_exchange.py (timing); not shipped.
Each node agent publishes, per destination node, the QP records its ranks hold toward
that node's ranks; after the exchange each node must hold exactly the records addressed
to its ranks.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import Mapping

from ibckpt.coordination.client import CoordinatorClient
from ibckpt.coordination.ranks import QP_RECORD
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.tlsfiles import shared_pki


def node_name(n: int) -> str:
    return f"node-{n:03d}"


def real_qpn(src: int, dst: int) -> int:
    return (src * 7919 + dst * 104729) & 0xFFFFFF


def segments_for(node: int, nodes: int, per_node: int) -> dict[str, bytes]:
    """What node `node` publishes: for each other node, its ranks' QPs toward that node's ranks."""
    out: dict[str, bytes] = {}
    pack = QP_RECORD.pack
    mine = range(node * per_node, (node + 1) * per_node)
    for other in range(nodes):
        if other == node:
            continue
        theirs = range(other * per_node, (other + 1) * per_node)
        out[node_name(other)] = b"".join(
            pack(s, 0x100000 + d, d, 0x100000 + s, real_qpn(s, d), s ^ d, 5, 5, 4)
            for s in mine
            for d in theirs
        )
    return out


def check_received(node: int, nodes: int, per_node: int, got: Mapping[str, bytes | memoryview]) -> int:
    """Assert `got` is exactly what node `node` must receive; return the record count."""
    assert sorted(got) == sorted(node_name(o) for o in range(nodes) if o != node)
    mine = set(range(node * per_node, (node + 1) * per_node))
    count = 0
    for sender, data in got.items():
        src_node = int(sender.split("-")[1])
        seen = set()
        for rec in QP_RECORD.iter_unpack(data):
            src, vqpn, dst, dst_vqpn, qpn = rec[0], rec[1], rec[2], rec[3], rec[4]
            assert dst in mine, f"record for rank {dst} delivered to {node_name(node)}"
            assert src // per_node == src_node, f"record of rank {src} came from {sender}"
            assert vqpn == 0x100000 + dst and dst_vqpn == 0x100000 + src and qpn == real_qpn(src, dst)
            seen.add((src, dst))
        assert len(seen) == per_node * per_node, f"{sender} -> {node_name(node)}: {len(seen)} records"
        count += len(seen)
    return count


def digest(got: Mapping[str, bytes | memoryview]) -> str:
    h = hashlib.sha256()
    for name in sorted(got):
        h.update(got[name])
    return h.hexdigest()


async def connect_nodes(
    host: str, port: int, session: str, tokens: dict[str, str], nodes: int, tls: ssl.SSLContext | None = None
) -> list[CoordinatorClient]:
    """One connected client per simulated node agent, node-000 first; `tls`: shared_pki()'s by default."""
    trusted = tls or shared_pki().client()
    return list(
        await asyncio.gather(
            *(
                CoordinatorClient.connect(
                    host, port, session, node_name(n), tokens[node_name(n)], tls=trusted
                )
                for n in range(nodes)
            )
        )
    )


async def exchange_all(
    clients: list[CoordinatorClient], outgoing: list[dict[str, bytes]], round_name: str = "rebuild-ids"
) -> tuple[list[dict[str, memoryview]], float]:
    """Every client publishes its segments and gathers its own; return what each got and the seconds."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(
        *(c.exchange(round_name, outgoing[n], timeout=120) for n, c in enumerate(clients))
    )
    return list(results), loop.time() - started


async def run_exchange(
    nodes: int, per_node: int, prepared: list[dict[str, bytes]] | None = None
) -> tuple[list[dict[str, memoryview]], float]:
    """Run one exchange round through a real server on 127.0.0.1; return what each node got and seconds.

    Server and clients share this process and its event loop (the bench also runs them apart).
    """
    server = CoordinatorServer(shared_pki().coordinator())
    await server.start()
    try:
        session, tokens = server.create_session({node_name(n) for n in range(nodes)}, deadline_s=600)
        clients = await connect_nodes("127.0.0.1", server.port, session, tokens, nodes)
        outgoing = prepared or [segments_for(n, nodes, per_node) for n in range(nodes)]
        results, elapsed = await exchange_all(clients, outgoing)
        for c in clients:
            await c.close()
        return results, elapsed
    finally:
        await server.stop()
