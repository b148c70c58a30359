"""Checkpoint cut and restore cost of the node driver: 16 all-to-all ranks on two Soft-RoCE guests.

Run from the repo root:  .venv/bin/python bench/node_quiesce.py [--ranks 16]

Half the ranks run on each guest (native/tests/a2a_seq under the shim, one RC QP per pair). The
bench takes two LeaveRunning checkpoints (the first with the cut as it was before stop 9:
`--quiesce-barrier --release-quiet --drain-stall-ms 100`, the second with the fast cut) and one
Stop checkpoint through the job coordinator and measures,
per node, the time from "checkpoint requested" (every node joined) until every rank is
quiesced, drained and released, barriers included, dump excluded. It then restores each node's
ranks twice from the same images: first with a raw CRIU restore of copies (the restored
processes are killed again), then with the driver (CRIU restore + rebuild + resume). The job
then finishes and must show exactly-once delivery. Prints both measurements side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCRIPT = """
half=$(( NRANKS / 2 ))
case $IBCKPT_NODE in
  1) mine=$(seq 0 $(( half - 1 ))) ;;
  2) mine=$(seq $half $(( NRANKS - 1 ))) ;;
esac
mine=$(echo $mine)
for r in $mine; do start_rank $r; done
for r in $mine; do wait_for READY {work}/r$r.out 600; done
sleep 3
IBCKPT_SESSION_TOKEN=$TOKEN_LROLD agent checkpoint --session {lrold} $(rank_args pid $mine) \
  --images {work}/images-lrold-$IBCKPT_NODE --mode LeaveRunning \
  --quiesce-barrier --release-quiet --drain-stall-ms 100 > {work}/lrold-node-$IBCKPT_NODE.json
sleep 3
IBCKPT_SESSION_TOKEN=$TOKEN_LR agent checkpoint --session {lr} $(rank_args pid $mine) \
  --images {work}/images-lr-$IBCKPT_NODE --mode LeaveRunning > {work}/lr-node-$IBCKPT_NODE.json
sleep 3
IBCKPT_SESSION_TOKEN=$TOKEN_STOP agent checkpoint --session {stop} $(rank_args pid $mine) \
  --images {work}/images --mode Stop > {work}/stop-node-$IBCKPT_NODE.json
{python} {bench} raw-restore {work}/images {work}/raw-$IBCKPT_NODE $mine > {work}/raw-node-$IBCKPT_NODE.json
IBCKPT_SESSION_TOKEN=$TOKEN_RESTORE agent restore --session {restore} --epoch 2 \
  $(rank_args img:{work}/images $mine) > {work}/restore-node-$IBCKPT_NODE.json
sleep 3
touch {work}/stop
for r in $mine; do wait_for DONE {work}/r$r.out 600; done
"""


def raw_restore(images: Path, scratch: Path, ranks: list[int]) -> dict[str, Any]:
    """In the guest: CRIU-restore copies of the ranks' images, as the driver would, then kill them."""
    from ibckpt_node import criu

    seconds: dict[str, float] = {}
    pids = []
    for r in ranks:
        name = f"a2a_rank-{r}_main_0"
        copy = scratch / name
        shutil.copytree(images / name, copy)
        result = criu.restore(copy, timeout_s=600)
        seconds[name] = result.seconds
        pids.append(result.pid)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids):  # their pids must be free again
        if time.monotonic() > deadline:
            raise SystemExit(f"restored copies did not exit: {pids}")
        time.sleep(0.05)
    return {"seconds": seconds, "total": sum(seconds.values())}


def _cut(report: dict[str, Any]) -> tuple[float, list[float], list[float], list[float], list[int]]:
    """Total cut, and per phase: wall time (barrier included), this node's own part, shim's slowest rank;
    then the sends drain left to rebuild and the ranks whose release counted every flush.

    The fast cut has no barrier after quiesce: its Drained phase covers quiesce and drain.
    """
    names = ("Quiesced", "Drained", "Released")
    wall = [report["phases"].get(n, 0.0) for n in names]
    local = [report["local"].get(n, 0.0) for n in names]
    shim = [
        max(reply["ms"] for reply in report["shim"][phase].values()) / 1000.0
        for phase in ("quiesce", "drain", "release")
    ]
    left = sum(reply["pending_sends"] for reply in report["shim"]["drain"].values())
    settled = sum(1 for reply in report["shim"]["release"].values() if reply.get("settled"))
    return sum(wall), wall, local, shim, [left, settled, len(report["shim"]["release"])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    sub = parser.add_subparsers(dest="cmd")
    raw = sub.add_parser("raw-restore")
    raw.add_argument("images", type=Path)
    raw.add_argument("scratch", type=Path)
    raw.add_argument("rank", type=int, nargs="+")
    args = parser.parse_args()
    if args.cmd == "raw-restore":
        print(json.dumps(raw_restore(args.images, args.scratch, args.rank)))
        return 0

    from node.a2a_job import assert_exactly_once, assert_ok, prelude

    from testbed.coordinator import ThreadedCoordinator, guest_envs
    from testbed.guest import GuestSpec, run_pair

    if args.ranks < 2 or args.ranks % 2:
        parser.error("--ranks must be even and >= 2")
    hosts = ["10.77.0.1"] * (args.ranks // 2) + ["10.77.0.2"] * (args.ranks // 2)
    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-node-"))
    coord = ThreadedCoordinator()
    coord.start()
    try:
        nodes = {"node-1", "node-2"}
        sessions: dict[str, str] = {}
        tokens: dict[str, dict[str, str]] = {}
        for name in ("lrold", "lr", "stop", "restore"):
            sessions[name], tokens[f"TOKEN_{name.upper()}"] = coord.create_session(nodes, deadline_s=1800)
        script = prelude(work, coord.port, hosts) + SCRIPT.format(
            work=work, python=sys.executable, bench=Path(__file__).resolve(), **sessions
        )
        env_1, env_2 = guest_envs(tokens)
        spec = GuestSpec(script, writable=[work], forward_ports=[coord.port], env=env_1)
        started = time.monotonic()
        results = run_pair(spec, dataclasses.replace(spec, env=env_2), timeout=1800)
        assert_ok(results, "bench", work)
        assert_exactly_once(work, args.ranks)
        guests_s = time.monotonic() - started
    finally:
        coord.stop()

    def load(name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((work / name).read_text())
        return data

    qps = args.ranks * (args.ranks - 1)
    print(f"{args.ranks} ranks on 2 guests, all-to-all over {qps // 2} RC connections ({qps} QPs)")
    print(f"two guests ran for {guests_s:.0f} s; every pair finished exactly-once\n")
    print("checkpoint requested -> every rank quiesced, drained, released (barriers included, no dump)")
    header = f"{'checkpoint':<13}{'node':<6}{'total ms':>9}{'quiesce':>9}{'drain':>8}{'release':>9}"
    print(f"{header}   node-local q/d/r   shim max q/d/r   sends left   settled releases")
    print("(LR old: the cut before stop 9: a barrier after quiesce, a 100 ms drain stall, release")
    print(" waiting for quiet CQs; the fast cut quiesces and drains each rank in one go, its quiesce")
    print(" column is 0 and its drain column holds both)")
    rows = (("LR old", "lrold"), ("LeaveRunning", "lr"), ("Stop", "stop"))
    worst: dict[str, float] = {}
    for label, prefix in rows:
        worst[prefix] = 0.0
        for node in (1, 2):
            total, wall, local, shim, (left, settled, n) = _cut(load(f"{prefix}-node-{node}.json"))
            worst[prefix] = max(worst[prefix], total)
            ms = [round(v * 1000) for v in wall]
            parts = "   ".join("/".join(str(round(v * 1000)) for v in vs) for vs in (local, shim))
            print(
                f"{label:<13}{node:<6}{total * 1000:>9.0f}{ms[0]:>9}{ms[1]:>8}{ms[2]:>9}   {parts}"
                f"   {left:>10}   {settled}/{n}"
            )
        print(f"{label:<13}{'all':<6}{worst[prefix] * 1000:>9.0f}   (goal <= 50 ms)")
    print(f"fast / old cut, LeaveRunning, slowest node: {worst['lr'] / worst['lrold']:.2f}")
    print("\nrestore of the same images, per node (sequential CRIU restores of its ranks)")
    print(f"{'node':<6}{'raw criu s':>11}{'driver s':>10}{'criu':>7}{'rebuild':>9}{'resume':>8}{'ratio':>7}")
    for node in (1, 2):
        raw_total = load(f"raw-node-{node}.json")["total"]
        phases = load(f"restore-node-{node}.json")["phases"]
        driver_total = sum(phases.values())
        print(
            f"{node:<6}{raw_total:>11.2f}{driver_total:>10.2f}{phases['Restored']:>7.2f}"
            f"{phases['Rebuilt']:>9.2f}{phases['Resumed']:>8.2f}{driver_total / raw_total:>7.2f}"
        )
    print("\nthe shim's rebuild on the restored ranks, slowest rank per step, ms")
    steps = ("open", "objects", "publish", "peers", "settle")
    print(f"{'node':<6}" + "".join(f"{step:>9}" for step in steps) + f"{'whole':>9}")
    for node in (1, 2):
        replies = load(f"restore-node-{node}.json")["shim"]["rebuild"].values()
        slowest = [max(r.get("steps_ms", {}).get(step, 0) for r in replies) for step in steps]
        whole = max(r["ms"] for r in replies)
        print(f"{node:<6}" + "".join(f"{v:>9}" for v in slowest) + f"{whole:>9}")
    if args.keep:
        print(f"\nwork dir: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
