"""A node's trees dump side by side (trees.dump_all), up to a bound, and a failure stops the ones not
started; pre-dumps (trees.pre_dump_all) likewise, and a dump on a pre-dump takes it in. The trees are
real processes (their /proc is read); CRIU is replaced by a recorder that takes its time, since what is
tested is the order of the dumps and where their images go, not what CRIU writes (the two-guest
tests/node/test_mixed_restart.py dumps on real pre-dumps)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode
from ibckpt_node import criu
from ibckpt_node.driver import NodeSettings
from ibckpt_node.leases import RankLeases
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import (
    PRE_DUMPS,
    TREE_MANIFEST,
    ProcessTree,
    dump_all,
    pre_dump_all,
    usable_parents,
    without_redirty,
)


class Recorder:
    """Stands in for criu.dump: each call takes `seconds`, the ones in `failing` fail."""

    def __init__(self, seconds: float, failing: frozenset[int] = frozenset()) -> None:
        self.seconds = seconds
        self.failing = failing
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.spans: dict[int, tuple[float, float]] = {}

    def __call__(
        self, pid: int, images: Path, options: criu.DumpOptions, timeout_s: float, parent: Path | None = None
    ) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        began = time.monotonic()
        time.sleep(self.seconds if pid not in self.failing else 0.05)
        with self.lock:
            self.running -= 1
            self.spans[pid] = (began, time.monotonic())
        if pid in self.failing:
            raise criu.CriuError("dump", str(pid), "exit status 1", "(a dump that failed)")
        images.mkdir(parents=True)
        if parent is not None:  # as CRIU does: a link to the pre-dump, relative to the images
            (images / criu.PARENT_LINK).symlink_to(criu.parent_arg(images, parent))


@pytest.fixture
def processes() -> Iterator[list[int]]:
    started = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        yield [p.pid for p in started]
    finally:
        for p in started:
            p.kill()
            p.wait()


def node(pids: list[int], tmp_path: Path) -> tuple[list[ProcessTree], list[LocalRank]]:
    trees = [ProcessTree(f"pod-{i}.main", pid) for i, pid in enumerate(pids)]
    ranks = [
        LocalRank(RankId("job", f"pod-{i}", "main", "0"), pid, tmp_path / f"{i}.sock")
        for i, pid in enumerate(pids)
    ]
    return trees, ranks


def run(
    pids: list[int], tmp_path: Path, parallel: int, parents: dict[str, Path] | None = None
) -> tuple[dict[str, Path], list[LocalRank]]:
    trees, ranks = node(pids, tmp_path)
    dumped: dict[str, Path] = {}
    leases = RankLeases("node-x", ranks, 30.0, 5.0)
    asyncio.run(
        dump_all(
            trees, ranks, Mode.LEAVE_RUNNING, tmp_path / "images", 60.0, leases, dumped, parallel, parents
        )
    )
    return dumped, ranks


def test_trees_dump_side_by_side_up_to_the_bound(
    processes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(0.5)
    monkeypatch.setattr(criu, "dump", recorder)
    started = time.monotonic()
    dumped, ranks = run(processes, tmp_path, parallel=3)
    assert recorder.most == 3 and time.monotonic() - started < 1.4  # not 3 x 0.5 s in turn
    for i, r in enumerate(ranks):
        images = tmp_path / "images" / f"pod-{i}.main"
        assert dumped[r.rank.key()] == images
        manifest = json.loads((images / TREE_MANIFEST).read_text())
        assert manifest["root_pid"] == r.pid and [e["key"] for e in manifest["ranks"]] == [r.rank.key()]

    bounded = Recorder(0.2)
    monkeypatch.setattr(criu, "dump", bounded)
    run(processes, tmp_path / "again", parallel=2)
    assert bounded.most == 2 and len(bounded.spans) == 3
    # one at a time, as the node did before
    single = Recorder(0.1)
    monkeypatch.setattr(criu, "dump", single)
    run(processes, tmp_path / "single", parallel=1)
    assert single.most == 1 and len(single.spans) == 3


def test_after_a_failed_dump_no_other_starts_and_the_running_ones_end_first(
    processes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, third = processes
    recorder = Recorder(0.6, failing=frozenset({first}))
    monkeypatch.setattr(criu, "dump", recorder)
    with pytest.raises(criu.CriuError):
        run(processes, tmp_path, parallel=2)
    assert set(recorder.spans) == {first, second}  # the third never started
    assert third not in recorder.spans and recorder.running == 0  # the second ended before the raise


def test_a_node_dumps_as_many_trees_at_once_as_it_has_cpus() -> None:
    assert NodeSettings().parallel_dumps == (os.cpu_count() or 1) >= 1


def test_pre_dumps_go_side_by_side_and_one_that_fails_leaves_its_tree_to_a_full_dump(
    processes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(0.4, failing=frozenset({processes[1]}))
    seen_plugins: list[str] = []

    def pre_dump(pid: int, images: Path, options: criu.DumpOptions, timeout_s: float, plugins: str) -> None:
        seen_plugins.append(plugins)
        recorder(pid, images, options, timeout_s)
        (images / "pages-1.img").write_bytes(b"x" * 4096)

    monkeypatch.setattr(criu, "pre_dump", pre_dump)
    trees, ranks = node(processes, tmp_path)
    root = tmp_path / "images"
    started = time.monotonic()
    done: dict[str, Path] = {}
    asyncio.run(pre_dump_all(trees, ranks, root, 60.0, "/plugins", 3, done))
    assert recorder.most == 3 and time.monotonic() - started < 1.0
    assert seen_plugins == ["/plugins"] * 3
    # the second failed: only logged, and nothing of it is left for its dump to take
    assert done == {
        "pod-0.main": root / PRE_DUMPS / "pod-0.main",
        "pod-2.main": root / PRE_DUMPS / "pod-2.main",
    }
    assert not (root / PRE_DUMPS / "pod-1.main").exists()

    # the dumps: the two with a pre-dump take it in as `parent`; the other is dumped in full
    dumps = Recorder(0.0)
    monkeypatch.setattr(criu, "dump", dumps)
    dumped, ranks = run(processes, tmp_path, parallel=3, parents=done)
    for i in (0, 2):
        parent = dumped[ranks[i].rank.key()] / criu.PARENT_LINK
        assert parent.is_dir() and not parent.is_symlink() and (parent / "pages-1.img").exists()
    assert not (dumped[ranks[1].rank.key()] / criu.PARENT_LINK).exists()
    assert not any((root / PRE_DUMPS).iterdir())


def test_a_pre_dump_is_used_only_where_every_rank_marked_its_device_pages(
    processes: list[int], tmp_path: Path
) -> None:
    trees, ranks = node(processes, tmp_path)
    releases = {
        ranks[0].rank.key(): {"redirtied_pages": 12, "redirty_missed_bytes": 0},
        ranks[1].rank.key(): {"redirtied_pages": 12, "redirty_missed_bytes": 4096},  # mprotected since
        ranks[2].rank.key(): {"ok": True},  # a shim build older than the mark
    }
    assert without_redirty(trees, ranks, releases) == {"pod-1.main", "pod-2.main"}
    # without trees, each rank is its own unit
    assert without_redirty([], ranks[:1], releases) == set()
    assert without_redirty([], ranks[:2], releases) == {"job_pod-1_main_0"}
    parents = {name: Path(name) for name in ("pod-0.main", "pod-1.main")}
    assert usable_parents(trees, ranks, releases, parents) == {"pod-0.main": Path("pod-0.main")}
