"""Process trees dumped and restored as one (a container's processes, ranks and all), and the dump of
every tree or lone rank of this node after the release."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode
from ibckpt_node import container_runtime, criu
from ibckpt_node.errors import CheckpointFailed, CheckpointRefused
from ibckpt_node.leases import RankLeases
from ibckpt_node.procfs import device_fds_and_maps, process_gone, process_tree
from ibckpt_node.ranks import LocalRank

log = logging.getLogger(__name__)

TREE_MANIFEST = "ibckpt-tree.json"
SHIM_BUILD = "shim_build"  # a container tree's key in it: the shim build its processes mapped (a digest)


@dataclass(frozen=True)
class ProcessTree:
    """A process tree dumped and restored as one: a container's processes, ranks and all.

    An MPI job's ranks are children of mpirun or of an orted daemon, connected to them by
    sockets and pipes; CRIU can only carry those if it dumps the whole tree. CRIU restores every
    pid as it was, so the manifest written beside the images names the ranks to rebuild.
    """

    name: str
    root_pid: int
    # A container's tree is dumped by its runtime (runc checkpoint), and restored by it.
    container: container_runtime.RuntimeContainer | None = None


def read_tree_manifest(images: Path) -> tuple[int, list[tuple[RankId, int, Path]]]:
    """The root pid and the ranks (key, pid, control socket) of a dumped process tree."""
    try:
        data = json.loads((images / TREE_MANIFEST).read_text())
        ranks = [(RankId.parse(r["key"]), int(r["pid"]), Path(r["control"])) for r in data["ranks"]]
        return int(data["root_pid"]), ranks
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFailed(f"{images}: not a dumped process tree ({TREE_MANIFEST}: {exc})") from exc


def tree_members(trees: Sequence[ProcessTree], ranks: Sequence[LocalRank]) -> dict[str, list[LocalRank]]:
    """Which ranks each process tree holds; a rank outside every tree is refused here."""
    members: dict[str, list[LocalRank]] = {t.name: [] for t in trees}
    below = {t.name: set(process_tree(t.root_pid)) for t in trees}
    for r in ranks:
        inside = [name for name, pids in below.items() if r.pid in pids]
        if trees and not inside:
            raise CheckpointRefused(
                f"{r.rank.key()} (pid {r.pid}) is in none of the process trees "
                f"{', '.join(f'{t.name} (root {t.root_pid})' for t in trees)}"
            )
        if inside:
            members[inside[0]].append(r)
    return members


def check_released(trees: Sequence[ProcessTree], ranks: Sequence[LocalRank]) -> None:
    # Every process of a tree goes into the image: none may hold the device either.
    processes: dict[int, str] = {}
    for t in trees:
        processes |= dict.fromkeys(process_tree(t.root_pid), f"process tree {t.name}")
    by_pid = {r.pid: r.rank.key() for r in ranks}
    processes |= by_pid  # a rank is named as itself
    for pid, who in processes.items():
        try:
            fds, maps = device_fds_and_maps(pid)
        except OSError as exc:
            if pid in by_pid:  # the application lost a rank after its release
                raise CheckpointFailed(f"{who} (pid {pid}): its process is gone ({exc})") from exc
            continue  # a tree's other process that ended holds nothing
        if fds or maps:
            raise CheckpointFailed(
                f"{who} (pid {pid}) still holds {fds} device fds and {maps} device "
                "mappings after release; refusing to dump"
            )


def lone_rank_dir(r: LocalRank) -> str:
    """The image dir's name of a rank dumped on its own (no tree)."""
    return r.rank.key().replace("/", "_")


async def dump_all(
    trees: Sequence[ProcessTree],
    ranks: Sequence[LocalRank],
    mode: Mode,
    images_root: Path,
    dump_s: float,
    leases: RankLeases,
    dumped: dict[str, Path],
    parallel: int = 1,
    parents: Mapping[str, Path] | None = None,
) -> None:
    """Dump every tree (each under images_root/NAME, with its manifest) or, without trees, every rank on
    its own; `dumped` gets each rank's image dir. Up to `parallel` trees dump at once: each CRIU freezes
    and walks its own tree, and a node's containers share nothing CRIU holds. After a failure no further
    tree starts; the ones dumping end (each within dump_s) before the first error is raised. A unit
    with a pre-dump in `parents` dumps only what changed since, and its image dir takes the pre-dump in
    (criu.adopt_parent)."""
    options = criu.DumpOptions(leave_running=mode is not Mode.STOP)
    members = tree_members(trees, ranks)
    parents = parents or {}
    slots = asyncio.Semaphore(max(1, parallel))
    failed: list[Exception] = []

    async def one(t: ProcessTree) -> None:
        images = images_root / t.name
        async with slots:
            if failed:
                return
            try:
                await dump_tree(t, members[t.name], options, images, dump_s, leases, parents.get(t.name))
            except Exception as exc:  # a cancellation (the phase's timeout) goes through
                failed.append(exc)
                return
        for r in members[t.name]:
            dumped[r.rank.key()] = images

    await asyncio.gather(*(one(t) for t in trees))
    if failed:
        raise failed[0]
    for r in [] if trees else ranks:  # with trees, preflight put every rank in one
        images, parent = images_root / lone_rank_dir(r), parents.get(lone_rank_dir(r))
        async with leases.unrenewed_while_dumped([r]):
            await asyncio.to_thread(criu.dump, r.pid, images, options, dump_s, parent)
        if parent is not None:
            criu.adopt_parent(images, parent)
        dumped[r.rank.key()] = images


async def dump_tree(
    t: ProcessTree,
    members: Sequence[LocalRank],
    options: criu.DumpOptions,
    images: Path,
    dump_s: float,
    leases: RankLeases,
    parent: Path | None = None,
) -> None:
    """Dump one tree into images, with the manifest a restore reads (TREE_MANIFEST); with `parent`,
    on that pre-dump of it."""
    build = None
    if t.container is not None:
        upper = container_runtime.upper_dir(t.root_pid)  # before Stop's dump ends the container
        shm = container_runtime.shm_dir(t.container)
        # what a restore must mount again (an old container's file is hashed: off the loop)
        build = await asyncio.to_thread(container_runtime.shim_build, t.container)
        dump = functools.partial(container_runtime.checkpoint, t.container)
        try:
            async with leases.unrenewed_while_dumped(members):
                await asyncio.to_thread(dump, images, options, dump_s, parent)
        except criu.CriuError as exc:
            gone = [r.rank.key() for r in members if process_gone(r.pid)]
            why = f" (the process of {', '.join(gone)} is gone)" if gone else ""
            raise CheckpointFailed(f"dump of container {t.name}{why} failed: {exc}") from exc
        # after the dump: with Stop nothing writes any more (LeaveRunning: see docs/node-agent.md)
        await asyncio.to_thread(container_runtime.save_rootfs_diff, upper, images)
        await asyncio.to_thread(container_runtime.save_shm, shm, images)
    else:
        async with leases.unrenewed_while_dumped(members):
            await asyncio.to_thread(criu.dump, t.root_pid, images, options, dump_s, parent)
    if parent is not None:
        criu.adopt_parent(images, parent)
    manifest: dict[str, Any] = {
        "root_pid": t.root_pid,
        "ranks": [{"key": r.rank.key(), "pid": r.pid, "control": str(r.control_path)} for r in members],
    }
    if t.container is not None:  # the runtime restores it, with matching options
        manifest["runtime"] = "runc"
        manifest["restore_args"] = container_runtime.restore_args(options)
        if build is not None:
            manifest[SHIM_BUILD] = build
    (images / TREE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
