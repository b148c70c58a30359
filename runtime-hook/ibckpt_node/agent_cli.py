"""`ibckpt-node`: run this node's part of one checkpoint or restore, as the node agent does.

    ibckpt-node checkpoint --coordinator HOST:PORT --session ID --node NAME \
        --rank KEY=PID:CONTROL_SOCKET ... --images DIR [--mode Stop|LeaveRunning] [--epoch N] \
        [--job-addr ADDR ...] [--tree NAME=ROOT_PID ...] [--drain-stall-ms N] [--quiesce-barrier]
        [--release-quiet]
    ibckpt-node restore --coordinator HOST:PORT --session ID --node NAME \
        --rank KEY=IMAGE_DIR:CONTROL_SOCKET ... [--rejoin KEY=PID:CONTROL_SOCKET ...] [--epoch N] \
        [--remap-ip OLD=NEW ...] [--tree IMAGE_DIR ...] [--device-map OLD=NEW ...]

Before any rank is touched, checkpoint refuses a rank with a TCP connection to an address that
is not one of the job's (--job-addr; default: every node of the session publishes its own), a
QP connected outside the job, or a verb the shim refused. --remap-ip rewrites the TCP socket
addresses in the images before CRIU restores them, so connections between ranks follow a move.
--device-map sends a restored rank's contexts on HCA OLD to this node's HCA NEW (the RestoreJob's
deviceMap, docs/rdma-pods.md); other devices keep their names. A NEW this node lacks is refused before
anything is restored; a device a rank used that has no counterpart here, before any rank rebuilds.

--tree dumps a whole process tree (say mpirun or orted with its ranks) as one image, under
IMAGES/NAME; every --rank must then be inside a tree. Restore it with --tree IMAGES/NAME: the
ranks to rebuild are read from the manifest beside the images.

A mixed restart (some ranks move, the rest stay): the staying node checkpoints with --mode Hold,
which leaves its ranks released, and passes them to its restore with --rejoin.

The session token (this --node's own credential: the coordinator refuses it for any other name)
comes from the IBCKPT_SESSION_TOKEN environment variable (never a flag: command lines are
world-readable); it is sent only over TLS to a coordinator whose certificate chains to --ca-file.
The shim's key-value socket is served at --shim-socket for the duration of the call. Prints a JSON
report (on failure too: what was done before it); exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from ibckpt.coordination.client import CoordinatorClient, CoordinatorError
from ibckpt.coordination.ranks import RankId
from ibckpt.devicemap import DeviceMapError
from ibckpt.tls import CA_FILE, TlsSetupError, client_context_from
from ibckpt.vocabulary import Mode, PhaseSeconds
from ibckpt_native.control import ControlError
from ibckpt_node import rdma_devices
from ibckpt_node.coord_proxy import Channel, ShimCoordinatorProxy
from ibckpt_node.criu import CriuError
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.predumps import PreDumpRounds
from ibckpt_node.priority import DEFAULT_BOOST_NICE
from ibckpt_node.ranks import LocalRank, NodeReport
from ibckpt_node.settings import CutOptions, NodeSettings
from ibckpt_node.tcp_remap import RemapError, parse_map
from ibckpt_node.trees import ProcessTree

DEFAULT_SHIM_SOCKET = "/run/ibckpt/coord.sock"


def _parse_rank(spec: str) -> tuple[RankId, str, Path]:
    key, sep, rest = spec.partition("=")
    where, sep2, control = rest.rpartition(":")
    if not sep or not sep2:
        raise argparse.ArgumentTypeError(f"--rank {spec!r}: expected KEY=PID_OR_IMAGES:CONTROL_SOCKET")
    return RankId.parse(key), where, Path(control)


def _parse_tree(spec: str) -> ProcessTree:
    name, sep, pid = spec.partition("=")
    if not sep or not name or "/" in name or not pid.isdigit():
        raise CheckpointFailed(f"--tree {spec!r}: expected NAME=ROOT_PID")
    return ProcessTree(name, int(pid))


def _parse_device_map(specs: Sequence[str]) -> dict[str, str]:
    """--device-map OLD=NEW ... as {old: new}; ValueError naming a bad one."""
    mapping: dict[str, str] = {}
    for spec in specs:
        old, sep, new = spec.partition("=")
        if not sep or not old or not new or old in mapping:
            raise ValueError(f"--device-map {spec!r}: expected OLD=NEW, each OLD once")
        mapping[old] = new
    return mapping


def _absent_targets(mapping: dict[str, str], sysfs: Path = rdma_devices.VERBS_SYSFS) -> str:
    """Why `mapping` cannot apply on this node (a target it does not have), or ""."""
    here = rdma_devices.node_devices(sysfs)
    missing = sorted({new for new in mapping.values() if new not in here})
    if not missing:
        return ""
    return f"--device-map names {', '.join(missing)}, not among this node's {', '.join(here) or 'none'}"


def _send_device_maps(
    mapping: dict[str, str], timeout_s: float
) -> Callable[[Sequence[LocalRank]], Awaitable[None]] | None:
    """The driver's before_rebuild for --device-map, None without one."""
    if not mapping:
        return None

    async def send(restored: Sequence[LocalRank]) -> None:
        try:
            await rdma_devices.map_by_hand(restored, mapping, timeout_s)
        except DeviceMapError as exc:
            raise CheckpointFailed(f"no device map fits: {exc}") from None
        except (ControlError, OSError) as exc:
            raise CheckpointFailed(f"{rdma_devices.MAP_REFUSED}: {exc}") from None

    return send


def _report_json(report: NodeReport) -> str:
    def default(value: Any) -> Any:
        return str(value) if isinstance(value, Path) else value

    return json.dumps(dataclasses.asdict(report), default=default, indent=2)


async def _run(args: argparse.Namespace, drivers: list[NodeDriver]) -> NodeReport:
    token = os.environ.get("IBCKPT_SESSION_TOKEN", "")
    if not token:
        raise CheckpointFailed("IBCKPT_SESSION_TOKEN is not set")
    try:
        tls = client_context_from(args.ca_file)
    except TlsSetupError as exc:
        raise CheckpointFailed(str(exc)) from exc
    host, _, port = args.coordinator.rpartition(":")
    client = await CoordinatorClient.connect(host, int(port), args.session, args.node, token, tls=tls)
    try:
        boost = None if args.no_boost else DEFAULT_BOOST_NICE
        shim_socket = Path(args.shim_socket)
        async with ShimCoordinatorProxy(client, [Channel(shim_socket)]) as proxy:

            def confine(_control: Path, gids: Sequence[str], qpns: Sequence[int]) -> None:
                proxy.confine_socket(shim_socket, gids, qpns)

            ranks = [_parse_rank(spec) for spec in args.rank]
            if args.command == "checkpoint":
                local = [LocalRank(rank, int(where), control) for rank, where, control in ranks]
                trees = [_parse_tree(spec) for spec in args.tree]
                driver = NodeDriver(
                    args.node,
                    client,
                    local,
                    timeouts=PhaseSeconds(),
                    settings=NodeSettings(
                        drain_stall_ms=args.drain_stall_ms,
                        pre_dump=bool(args.criu_plugins),
                        criu_plugins=args.criu_plugins,
                        pre_dump_rounds=PreDumpRounds(settle_bytes=args.pre_dump_settle_bytes),
                    ),
                    job_addrs=args.job_addr or None,
                    trees=trees,
                    boost_nice=boost,
                    cut=CutOptions(quiesce_barrier=args.quiesce_barrier, release_quiet=args.release_quiet),
                    flush_records=proxy.published,
                    confine=confine,
                )
                drivers.append(driver)
                try:
                    return await driver.checkpoint(Mode(args.mode), Path(args.images), args.epoch)
                finally:
                    await driver.end_leases()  # a Hold leaves its ranks held, with no lease
            driver = NodeDriver(
                args.node, client, [], boost_nice=boost, flush_records=proxy.published, confine=confine
            )
            drivers.append(driver)
            images = {rank.key(): Path(where) for rank, where, _ in ranks}
            controls = {rank.key(): control for rank, _, control in ranks}
            held = [_parse_rank(spec) for spec in args.rejoin]
            rejoin = [LocalRank(rank, int(where), control) for rank, where, control in held]
            remap = parse_map(args.remap_ip)
            tree_dirs = [Path(spec) for spec in args.tree]
            maps = _send_device_maps(_parse_device_map(args.device_map), driver.timeouts.quiesce_seconds)
            return await driver.restore(images, controls, args.epoch, rejoin, remap, tree_dirs, maps)
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ibckpt-node", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["checkpoint", "restore"])
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the job coordinator")
    parser.add_argument("--session", required=True)
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=Path("/etc/ibckpt/agent-tls") / CA_FILE,
        help="the operator's CA: the coordinator's certificate must chain to it (default: %(default)s, "
        "the agent's)",
    )
    parser.add_argument("--node", required=True, help="this node's participant name")
    parser.add_argument("--rank", action="append", default=[])
    parser.add_argument(
        "--tree", action="append", default=[], help="checkpoint: NAME=ROOT_PID; restore: IMAGE_DIR"
    )
    parser.add_argument("--rejoin", action="append", default=[], help="restore: KEY=PID:CONTROL_SOCKET held")
    parser.add_argument("--images", help="checkpoint: where the CRIU images go")
    parser.add_argument("--mode", default=Mode.LEAVE_RUNNING.value, choices=[m.value for m in Mode])
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--shim-socket", default=DEFAULT_SHIM_SOCKET)
    parser.add_argument(
        "--no-boost",
        action="store_true",
        help=f"keep the agent's and ranks' control threads' nice value (else {DEFAULT_BOOST_NICE})",
    )
    cut = parser.add_argument_group("the cut (checkpoint); the defaults are the fast cut")
    cut.add_argument(
        "--drain-stall-ms",
        type=int,
        default=NodeSettings.drain_stall_ms,
        help="end a drain after this long without a completion when rebuild can settle what is left",
    )
    cut.add_argument("--quiesce-barrier", action="store_true", help="wait for every node after quiesce too")
    cut.add_argument(
        "--criu-plugins",
        default="",
        metavar="DIR",
        help="pre-dump each tree before the cut with CRIU's plugins in DIR (ibckpt_uverbs.so); every node "
        "of the job must be given one",
    )
    cut.add_argument(
        "--pre-dump-settle-bytes",
        type=int,
        default=PreDumpRounds.settle_bytes,
        metavar="N",
        help="pre-dump a tree again while its last round wrote more than N bytes of pages (and shrank)",
    )
    cut.add_argument(
        "--release-quiet", action="store_true", help="release waits for quiet CQs instead of counting flushes"
    )
    parser.add_argument(
        "--job-addr", action="append", default=[], help="checkpoint: an address of the job's nodes"
    )
    parser.add_argument(
        "--remap-ip", action="append", default=[], help="restore: OLD=NEW, rewrite TCP socket addresses"
    )
    parser.add_argument(
        "--device-map", action="append", default=[], help="restore: OLD=NEW, reopen HCA OLD's contexts on NEW"
    )
    args = parser.parse_args(argv)
    if args.command == "checkpoint" and not args.images:
        parser.error("checkpoint needs --images")
    if not args.rank and not (args.command == "restore" and args.tree):
        parser.error("give at least one --rank (or, to restore, a --tree)")
    try:
        parse_map(args.remap_ip)
        device_map = _parse_device_map(args.device_map)
    except ValueError as exc:
        parser.error(str(exc))
    if device_map and args.command != "restore":
        parser.error("--device-map is for restore")
    absent = _absent_targets(device_map)
    if absent:  # before anything is restored
        print(f"ibckpt-node: restore refused: {absent}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    drivers: list[NodeDriver] = []
    try:
        report = asyncio.run(_run(args, drivers))
    except (CheckpointFailed, CoordinatorError, CriuError, RemapError) as exc:
        if drivers:  # what was done before the failure (outcome Refused, Aborted or empty)
            print(_report_json(drivers[0].report))
        print(f"ibckpt-node: {args.command} failed: {exc}", file=sys.stderr)
        return 1
    print(_report_json(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
