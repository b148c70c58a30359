"""A node's trees dump side by side (trees.dump_all), up to a bound, and a failure stops the ones not
started; pre-dumps (predumps.pre_dump_all) likewise, in rounds while they shrink, and a dump on a
pre-dump takes its chain of rounds in. The trees are
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
from ibckpt_node.leases import RankLeases
from ibckpt_node.predumps import (
    PRE_DUMPS,
    PreDumpRounds,
    forget_rounds,
    pre_dump_all,
    round_dir,
    usable_parents,
    without_redirty,
)
from ibckpt_node.ranks import LocalRank
from ibckpt_node.settings import NodeSettings
from ibckpt_node.trees import TREE_MANIFEST, ProcessTree, dump_all


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

    def pre_dump(
        pid: int, images: Path, options: criu.DumpOptions, timeout_s: float, plugins: str, parent: Path | None
    ) -> None:
        seen_plugins.append(plugins)
        recorder(pid, images, options, timeout_s, parent)
        (images / "pages-1.img").write_bytes(b"x" * 4096)  # small: one round

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
        "pod-0.main": round_dir(root, "pod-0.main", 1),
        "pod-2.main": round_dir(root, "pod-2.main", 1),
    }
    assert not round_dir(root, "pod-1.main", 1).exists()

    # the dumps: the two with a pre-dump take it in as `parent`; the other is dumped in full
    dumps = Recorder(0.0)
    monkeypatch.setattr(criu, "dump", dumps)
    dumped, ranks = run(processes, tmp_path, parallel=3, parents=done)
    for i in (0, 2):
        parent = dumped[ranks[i].rank.key()] / criu.PARENT_LINK
        assert parent.is_dir() and not parent.is_symlink() and (parent / "pages-1.img").exists()
    assert not (dumped[ranks[1].rank.key()] / criu.PARENT_LINK).exists()
    forget_rounds(root)
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


def test_rounds_go_on_while_they_shrink_and_the_dump_takes_the_chain_in(
    processes: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bytes of pages each round writes, by tree: one converges, one does not, one's second round fails
    sizes = {processes[0]: [8000, 3000, 900], processes[1]: [8000, 6000], processes[2]: [8000]}
    calls: list[tuple[int, Path | None]] = []
    recorder = Recorder(0.0)

    def pre_dump(
        pid: int, images: Path, options: criu.DumpOptions, timeout_s: float, plugins: str, parent: Path | None
    ) -> None:
        calls.append((pid, parent))
        if pid == processes[2] and parent is not None:
            images.mkdir(parents=True)
            (images / "pages-1.img").write_bytes(b"partial")
            raise criu.CriuError("pre-dump", str(pid), "exit status 1", "(a round that failed)")
        recorder(pid, images, options, timeout_s, parent)
        (images / "pages-1.img").write_bytes(b"x" * sizes[pid].pop(0))

    monkeypatch.setattr(criu, "pre_dump", pre_dump)
    trees, ranks = node(processes, tmp_path)
    root = tmp_path / "images"
    done: dict[str, Path] = {}
    rounds = PreDumpRounds(most=5, settle_bytes=1000, shrink=0.5)
    asyncio.run(pre_dump_all(trees, ranks, root, 60.0, "/plugins", 3, done, rounds))
    # 8000, 3000 (shrank by half), 900 (settled); 8000, 6000 (did not shrink by half); 8000, a failure
    assert done == {
        "pod-0.main": round_dir(root, "pod-0.main", 3),
        "pod-1.main": round_dir(root, "pod-1.main", 2),
        "pod-2.main": round_dir(root, "pod-2.main", 1),
    }
    by_pid = {pid: [parent for p, parent in calls if p == pid] for pid in processes}
    assert by_pid[processes[0]] == [None, round_dir(root, "pod-0.main", 1), round_dir(root, "pod-0.main", 2)]
    assert by_pid[processes[2]] == [None, round_dir(root, "pod-2.main", 1)]
    assert not round_dir(root, "pod-2.main", 2).exists()  # the failed round left nothing

    monkeypatch.setattr(criu, "dump", Recorder(0.0))
    dumped, ranks = run(processes, tmp_path, parallel=3, parents=done)
    forget_rounds(root)
    assert not any((root / PRE_DUMPS).iterdir())
    # each dump holds its chain as real dirs, newest round first, each with its own pages
    for i, want in ((0, [900, 3000, 8000]), (1, [6000, 8000]), (2, [8000])):
        where, got = dumped[ranks[i].rank.key()], []
        while (where := where / criu.PARENT_LINK).exists():
            assert where.is_dir() and not where.is_symlink(), where
            got.append(criu.pages_bytes(where))
        assert got == want, (i, got)


def test_a_round_is_run_only_while_it_pays() -> None:
    rounds = PreDumpRounds(most=3, settle_bytes=100, shrink=0.5)
    assert rounds.another(1, [1000], last_s=1.0, left_s=10.0)
    assert not rounds.another(1, [100], last_s=1.0, left_s=10.0)  # settled: the dump copies that much
    assert not rounds.another(1, [1000], last_s=6.0, left_s=10.0)  # another might not end in the bound
    assert rounds.another(2, [1000, 500], last_s=1.0, left_s=10.0)
    assert not rounds.another(2, [1000, 501], last_s=1.0, left_s=10.0)  # not converging
    assert not rounds.another(3, [1000, 400, 150], last_s=1.0, left_s=10.0)  # the most
