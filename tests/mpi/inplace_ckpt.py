"""In-place checkpoints of an MPI job's ranks through their shim control sockets, across two guests.

No CRIU and no node agent: each guest drives the ranks of its own node through quiesce, drain,
release, rebuild and resume, and the two guests meet at a barrier before every phase. The barriers
and the shim's rebuild records go through one small key-value coordinator (the shim's PUT/GET line
protocol, docs/native-shim.md) served over TCP on node-1's link address.

  python3 inplace_ckpt.py coord --bind ADDR --port N
  python3 inplace_ckpt.py drive --coord ADDR:PORT --node N --nodes 2 --sockets 'GLOB' \
      --count K --delay S --gap S

stdlib only (plus ibckpt_native.control and shimtest.coordinator, both stdlib only): it runs in
slow TCG guests, with native/ on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import glob
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ibckpt_native.control import ControlError, ShimControl, exchange_line
from shimtest.coordinator import serve_tcp

# ---------------------------------------------------------------- driver


def _kv(coord: tuple[str, int], line: str) -> str:
    with socket.create_connection(coord, timeout=300) as s:
        return exchange_line(s, line).decode().strip()


def barrier(coord: tuple[str, int], name: str, node: int, nodes: int, timeout_s: float = 240) -> None:
    _kv(coord, f"PUT bar/{name}/{node} 1")
    for other in range(1, nodes + 1):
        if other != node and _kv(coord, f"GET bar/{name}/{other} {int(timeout_s * 1000)}") == "NONE":
            raise TimeoutError(f"barrier {name}: node {other} never arrived")


def _summary(reply: dict[str, Any]) -> str:
    qps = reply.get("qps") or []
    keep = {k: reply[k] for k in ("phase", "ok", "ms", "state", "device_fds", "device_maps") if k in reply}
    return f"{json.dumps(keep)} qps={len(qps)}"


def drive(args: argparse.Namespace) -> int:
    host, _, port = args.coord.rpartition(":")
    coord = (host, int(port))
    deadline = time.monotonic() + args.wait
    paths: list[str] = []
    while time.monotonic() < deadline:
        paths = sorted(glob.glob(args.sockets))
        if len(paths) >= args.ranks:
            break
        time.sleep(0.5)
    if not paths:
        print(f"inplace_ckpt: no control socket matches {args.sockets}", flush=True)
        return 1
    ranks = [ShimControl(p, timeout=300) for p in paths]
    for r in ranks:
        print(f"inplace_ckpt: node {args.node} rank {r.path}: {json.dumps(r.hello())}", flush=True)
    time.sleep(args.delay)
    for epoch in range(1, args.count + 1):
        for phase in ("quiesce", "drain", "release", "rebuild", "resume"):
            barrier(coord, f"{epoch}/{phase}", args.node, args.nodes)
            # All local ranks at once: a rank's rebuild waits for its peers' records.
            with ThreadPoolExecutor(len(ranks)) as pool:
                results = list(pool.map(_phase, ranks, [phase] * len(ranks), [epoch + 1] * len(ranks)))
            failed = False
            for r, (took, reply, err) in zip(ranks, results, strict=True):
                where = f"inplace_ckpt: node {args.node} #{epoch} {phase}"
                if err is not None:
                    print(f"{where} {r.path} FAILED: {err}", flush=True)
                    failed = True
                else:
                    print(f"{where} {took:.2f}s {_summary(reply)}", flush=True)
            if failed:
                _recover(ranks, epoch + 1)
                return 1
        print(f"inplace_ckpt: node {args.node} checkpoint {epoch} done", flush=True)
        time.sleep(args.gap)
    return 0


def _phase(r: ShimControl, phase: str, epoch: int) -> tuple[float, dict[str, Any], Exception | None]:
    t0 = time.monotonic()
    try:
        if phase == "rebuild":
            reply = r.rebuild(epoch, 120000)
        elif phase == "resume":
            reply = r.resume()
        else:
            reply = getattr(r, phase)(60000)
    except (OSError, ControlError) as exc:
        return time.monotonic() - t0, {}, exc
    return time.monotonic() - t0, reply, None


def _recover(ranks: list[ShimControl], epoch: int) -> None:
    """Let the job go on after a failed phase: abort, or rebuild and resume once released."""

    def one(r: ShimControl) -> None:
        try:
            state = r.status().get("state")
            if state == "released":
                r.rebuild(epoch, 120000)
            if state in ("released", "rebuilt"):
                r.resume()
            else:
                r.abort()
        except (OSError, ControlError) as exc:
            print(f"inplace_ckpt: recovering {r.path} failed: {exc}", flush=True)

    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(one, ranks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inplace_ckpt.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("coord")
    c.add_argument("--bind", required=True)
    c.add_argument("--port", type=int, required=True)
    d = sub.add_parser("drive")
    d.add_argument("--coord", required=True)
    d.add_argument("--node", type=int, required=True)
    d.add_argument("--nodes", type=int, default=2)
    d.add_argument("--sockets", required=True, help="glob of the local ranks' control sockets")
    d.add_argument("--ranks", type=int, default=1)
    d.add_argument("--count", type=int, default=1)
    d.add_argument("--delay", type=float, default=5.0)
    d.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the sockets")
    d.add_argument("--gap", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.cmd == "coord":
        serve_tcp(args.bind, args.port)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
