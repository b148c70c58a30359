"""Pre-dumps before the cut: each tree's memory copied while it runs, in rounds, so the final dump copies
only the pages written since the last round (docs/node-agent.md, "Pre-dumps").

A round after the first names the one before as its parent and copies only what changed since, as the
dump does. Rounds go on while they shrink: the freeze of the dump is about the size of the last round's
pages, so a round pays when that is still large and the application writes slower than CRIU copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibckpt_node import container_runtime, criu
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import ProcessTree, lone_rank_dir, tree_members

log = logging.getLogger(__name__)

PRE_DUMPS = ".pre-dumps"  # under the images' root: each unit's rounds, until its dump adopts them


@dataclass(frozen=True)
class PreDumpRounds:
    """When a unit is pre-dumped again, on its last round."""

    most: int = 3
    # A round whose pages are at most this ends the rounds: the dump's freeze copies about that much,
    # and a further round costs CRIU's fixed work (seize, parasite, a short freeze) for little.
    settle_bytes: int = 64 << 20
    # A round that kept more than this share of the round before is not converging: the application
    # writes about as fast as CRIU copies, and another round would copy the same pages again.
    shrink: float = 0.7

    def another(self, done: int, pages: Sequence[int], last_s: float, left_s: float) -> bool:
        """Whether to run round done+1 after rounds that wrote `pages` bytes each, the last in last_s
        seconds, with left_s of the phase's bound left (a round may take as long as the last, twice)."""
        if done >= self.most or pages[-1] <= self.settle_bytes or left_s < 2 * last_s:
            return False
        return len(pages) < 2 or pages[-1] <= self.shrink * pages[-2]


def round_dir(images_root: Path, name: str, number: int) -> Path:
    return images_root / PRE_DUMPS / name / f"round-{number}"


async def pre_dump_all(
    trees: Sequence[ProcessTree],
    ranks: Sequence[LocalRank],
    images_root: Path,
    bound_s: float,
    plugins: str,
    parallel: int,
    done: dict[str, Path],
    rounds: PreDumpRounds = PreDumpRounds(),
) -> None:
    """Pre-dump every tree (or, without trees, every rank) while it runs, up to `parallel` at once;
    each unit's last round that succeeded goes into `done`, by the name of the dir its dump will have
    (so a bounded phase that cuts this short keeps those). A round that fails is only logged: its unit
    builds on the round before, or is dumped in full, as without pre-dumps."""
    units = [(t.name, t.root_pid, t.container) for t in trees] or [
        (lone_rank_dir(r), r.pid, None) for r in ranks
    ]
    slots = asyncio.Semaphore(max(1, parallel))
    started = time.monotonic()

    async def one(name: str, pid: int, container: container_runtime.RuntimeContainer | None) -> None:
        pages: list[int] = []
        parent: Path | None = None
        while True:
            where = round_dir(images_root, name, len(pages) + 1)
            async with slots:
                round_started = time.monotonic()
                try:
                    await asyncio.to_thread(pre_dump_one, pid, container, where, bound_s, plugins, parent)
                except criu.CriuError as exc:
                    log.warning("pre-dump round %d of %s failed: %s", len(pages) + 1, name, exc)
                    await asyncio.to_thread(shutil.rmtree, where, True)
                    if parent is None:
                        log.warning("%s is dumped in full", name)
                    return
            done[name] = parent = where
            pages.append(criu.pages_bytes(where))
            last_s = time.monotonic() - round_started
            if not rounds.another(len(pages), pages, last_s, bound_s - (time.monotonic() - started)):
                break
        log.info("%s: %d pre-dump round(s), pages %s bytes", name, len(pages), pages)

    await asyncio.gather(*(one(*unit) for unit in units))


def forget_rounds(images_root: Path) -> None:
    """Remove the units' dirs whose rounds their dumps took in (a round a dump did not take stays with
    the session's images, as they do)."""
    for unit in (images_root / PRE_DUMPS).glob("*"):
        with contextlib.suppress(OSError):  # not empty: kept
            unit.rmdir()


def pre_dump_one(
    pid: int,
    container: container_runtime.RuntimeContainer | None,
    where: Path,
    bound_s: float,
    plugins: str,
    parent: Path | None,
) -> None:
    """One round of one unit: through its runtime for a container, else CRIU on the tree's root."""
    if container is not None:
        container_runtime.checkpoint(
            container, where, criu.DumpOptions(), bound_s, parent, pre_dump_plugins=plugins
        )
    else:
        criu.pre_dump(pid, where, criu.DumpOptions(), bound_s, plugins, parent)


def usable_parents(
    trees: Sequence[ProcessTree],
    ranks: Sequence[LocalRank],
    releases: Mapping[str, Mapping[str, Any]],
    parents: Mapping[str, Path],
) -> dict[str, Path]:
    """The pre-dumps the final dumps may build on: none for a tree whose ranks' release did not mark
    the pages their devices wrote (without_redirty), which is dumped in full."""
    stale = without_redirty(trees, ranks, releases)
    for name in sorted(stale & parents.keys()):
        log.warning("%s is dumped in full: a rank's release did not mark its device's pages", name)
    return {name: where for name, where in parents.items() if name not in stale}


def without_redirty(
    trees: Sequence[ProcessTree], ranks: Sequence[LocalRank], releases: Mapping[str, Mapping[str, Any]]
) -> set[str]:
    """The units (tree names, or lone ranks' dirs) with a rank whose release did not mark every page its
    device may have written (native/src/redirty.c): a dump on their pre-dump could keep a stale page.
    A shim build older than that mark says nothing about it, and counts too."""

    def unmarked(r: LocalRank) -> bool:
        reply = releases.get(r.rank.key(), {})
        return "redirtied_pages" not in reply or reply.get("redirty_missed_bytes") != 0

    if trees:
        return {name for name, rs in tree_members(trees, ranks).items() if any(unmarked(r) for r in rs)}
    return {lone_rank_dir(r) for r in ranks if unmarked(r)}
