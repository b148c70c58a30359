"""Time the coordinator's id exchange for a simulated job (goal: < 1 s for 2,048 ranks on 128 nodes).

Run: .venv/bin/python bench/coordinator_exchange.py [--nodes 128] [--ranks-per-node 16] [--mode both]
All-to-all: every rank has one QP toward every rank on another node (~4M records of 48 bytes
for 2,048 ranks). Record generation is excluded; the time is from the first publish until
every node holds its records, through a real server and one TCP client per node on 127.0.0.1.

Two measurements, side by side:
  one process   the server and all clients in this process, on one event loop (and so one core):
                everybody's work, the number this bench always printed;
  server alone  the server in this process, the clients in a child process with their own loop,
                as in production, where the clients are other nodes. The wall time is taken by
                the clients (from "go" until every node holds its records); "server CPU" is the
                CPU time this process spent meanwhile, i.e. the server's own cost.
CPU seconds are printed beside wall seconds because on a busy 2-core machine the wall time also
counts the time other work held the core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the simulated job the tests use

from ibckpt.coordination.ranks import QP_RECORD
from ibckpt.tls import client_context
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.simulated_job import connect_nodes, exchange_all, node_name, segments_for
from testbed.tlsfiles import shared_pki


class Timing(NamedTuple):
    wall: float
    server_cpu: float  # one process: the whole process, server and clients
    clients_cpu: float = float("nan")


def _expected_bytes(nodes: int, per: int) -> int:
    return (nodes - 1) * per * per * QP_RECORD.size  # what each node must receive


async def one_process(nodes: int, per: int, prepared: list[dict[str, bytes]]) -> Timing:
    server = CoordinatorServer(shared_pki().coordinator())
    await server.start()
    try:
        session, tokens = server.create_session({node_name(n) for n in range(nodes)}, deadline_s=600)
        clients = await connect_nodes("127.0.0.1", server.port, session, tokens, nodes)
        cpu = time.process_time()
        results, wall = await exchange_all(clients, prepared)
        cpu = time.process_time() - cpu
        for got in results:
            assert sum(len(v) for v in got.values()) == _expected_bytes(nodes, per)
        for c in clients:
            await c.close()
        return Timing(wall, cpu)
    finally:
        await server.stop()


async def server_alone(nodes: int, per: int) -> Timing:
    server = CoordinatorServer(shared_pki().coordinator())
    await server.start()
    try:
        session, tokens = server.create_session({node_name(n) for n in range(nodes)}, deadline_s=600)
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--nodes", str(nodes), "--ranks-per-node", str(per),
            "--clients-for", str(server.port), session,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        secrets = {"tokens": tokens, "ca": shared_pki().ca.ca_crt.decode()}  # the child trusts this CA
        child.stdin.write(json.dumps(secrets).encode() + b"\n")  # not on the command line
        await child.stdin.drain()
        if (await child.stdout.readline()).strip() != b"ready":
            raise RuntimeError("the clients' process did not get ready")
        cpu = time.process_time()
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        done = (await child.stdout.readline()).split()
        cpu = time.process_time() - cpu
        if await child.wait() != 0 or len(done) != 3 or done[0] != b"done":
            raise RuntimeError(f"the clients' process failed ({done!r})")
        return Timing(float(done[1]), cpu, float(done[2]))
    finally:
        await server.stop()


async def clients_role(port: int, session: str, nodes: int, per: int) -> None:
    """The child of server_alone: every node's client, on this process's own loop."""
    given = json.loads(sys.stdin.readline())
    prepared = [segments_for(n, nodes, per) for n in range(nodes)]
    tls = client_context(given["ca"].encode())
    clients = await connect_nodes("127.0.0.1", port, session, given["tokens"], nodes, tls)
    print("ready", flush=True)
    sys.stdin.readline()  # blocking is fine: the clients have nothing to do until "go"
    cpu = time.process_time()
    results, wall = await exchange_all(clients, prepared)
    cpu = time.process_time() - cpu
    for got in results:
        assert sum(len(v) for v in got.values()) == _expected_bytes(nodes, per)
    print(f"done {wall:.6f} {cpu:.6f}", flush=True)
    for c in clients:
        await c.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ranks-per-node", type=int, default=16)
    parser.add_argument("--mode", choices=["both", "one-process", "server-alone"], default="both")
    parser.add_argument("--clients-for", nargs=2, metavar=("PORT", "SESSION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    per = args.ranks_per_node
    if args.clients_for:
        asyncio.run(clients_role(int(args.clients_for[0]), args.clients_for[1], args.nodes, per))
        return
    print(f"{'':>34}| {'one process':^21}| {'server alone (clients in a child)':^37}")
    print(
        f"{'nodes':>6} {'ranks':>6} {'records':>10} {'MiB':>7}  |"
        f" {'wall s':>8} {'CPU s':>8}   | {'wall s':>8} {'server CPU s':>13} {'clients CPU s':>13}"
    )
    for nodes in sorted({2, 16, args.nodes}):
        size = nodes * _expected_bytes(nodes, per)
        one = two = Timing(float("nan"), float("nan"))
        if args.mode in ("both", "one-process"):
            prepared = [segments_for(n, nodes, per) for n in range(nodes)]
            one = asyncio.run(one_process(nodes, per, prepared))
            del prepared
        if args.mode in ("both", "server-alone"):
            two = asyncio.run(server_alone(nodes, per))
        print(
            f"{nodes:>6} {nodes * per:>6} {size // QP_RECORD.size:>10} {size / 2**20:>7.1f}  |"
            f" {one.wall:>8.3f} {one.server_cpu:>8.3f}   |"
            f" {two.wall:>8.3f} {two.server_cpu:>13.3f} {two.clients_cpu:>13.3f}"
        )


if __name__ == "__main__":
    main()
