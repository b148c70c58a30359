"""Preflight's room check on the host: the images' size is estimated from the resident memory of every
process the dump saves, and a checkpoint that would not fit where its images go is refused before any
rank is touched; on a tmpfs, the images must also fit in the agent's memory limit. A restore's staging
is held to the same rules, its size read from the checkpoint's manifest. Only the disk's free space
(shutil.disk_usage) and, for the tmpfs rule, the mounts and cgroup files are faked: the processes, /proc,
the driver, its coordinator and the shim's control socket are real or the usual stand-ins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from node.driver_harness import connected_driver, failed_checkpoint, unwritable_images
from node.fake_shim import FakeShimSocket
from store.conftest import sample_manifest

from ibckpt.coordination.ranks import RankId
from ibckpt.store.manifest import ChunkRef, FileRecord, Manifest
from ibckpt.vocabulary import Mode
from ibckpt_node import preflight
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.ranks import LocalRank
from ibckpt_node.trees import ProcessTree
from testbed.coordinator import ThreadedCoordinator

MIB = 1 << 20


@pytest.fixture
def big() -> Iterator[int]:
    """A process that holds 80 MiB resident (touched, not just mapped); its pid."""
    code = "import time; b = bytearray(80 << 20); b[::4096] = b'x' * (80 << 8); print(1, flush=True); "
    code += "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_the_estimate_is_the_resident_memory_plus_a_margin_and_the_boundary_fits() -> None:
    resident = 1000 * MIB
    need = preflight.image_estimate(resident)
    assert need == resident + resident // 10 + 64 * MIB
    assert preflight.disk_problem(resident, 3, need, Path("/var/lib/ibckpt")) is None
    refused = preflight.disk_problem(resident, 3, need - 1, Path("/var/lib/ibckpt"))
    assert refused is not None
    assert refused == (
        f"refusing to checkpoint on this node: its images would need about 1.1 GiB ({need} bytes: "
        f"1000.0 MiB resident in 3 processes, plus 10% and 64 MiB) and /var/lib/ibckpt has 1.1 GiB "
        f"({need - 1} bytes) free"
    )
    # the agent's --disk-reserve-bytes stays free on top of the images
    reserve = 512 * MIB
    assert preflight.disk_problem(resident, 3, need + reserve, Path("/d"), reserve) is None
    short = preflight.disk_problem(resident, 3, need + reserve - 1, Path("/d"), reserve)
    assert short is not None and short.endswith(
        f"free, of which the agent leaves 512.0 MiB ({reserve} bytes) to the node"
    ), short


def test_resident_memory_is_read_for_every_process_of_a_tree(big: int) -> None:
    assert preflight.resident_bytes(big) >= 80 * MIB
    assert preflight.resident_bytes(2**22 + 7) == 0  # no such process
    # the tree of this test's process holds `big`: its memory counts once, with its parent's
    pids = preflight.dumped_processes([ProcessTree("t", os.getpid())], [])
    assert big in pids
    # without trees, each rank's own process (and its children) is what is dumped
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, Path("/nonexistent"))
    assert preflight.dumped_processes([], [rank, rank]) == {big}


def test_the_free_space_is_asked_of_the_nearest_directory_that_exists(tmp_path: Path) -> None:
    assert preflight.existing(tmp_path / "sessions" / "s1" / "images") == tmp_path


def _free(monkeypatch: pytest.MonkeyPatch, free: int) -> list[str]:
    """shutil.disk_usage reports `free` bytes; returns the paths it was asked about."""
    asked: list[str] = []

    def disk_usage(path: str | Path) -> SimpleNamespace:
        asked.append(str(path))
        return SimpleNamespace(total=free * 2, used=free, free=free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return asked


async def test_a_checkpoint_that_would_not_fit_is_refused_before_any_rank_is_touched(
    coordinator: ThreadedCoordinator, tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _free(monkeypatch, 50 * MIB)
    monkeypatch.setenv("PATH", "/nonexistent")  # no CRIU reaches the process, whatever happens
    shim = FakeShimSocket(tmp_path / "r.ctl")
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, shim.path)
    driver = await connected_driver(coordinator, [rank], None)
    images = tmp_path / "sessions" / "s1" / "images"
    failed = await failed_checkpoint(
        driver,
        Mode.STOP,
        images,
        "refusing to checkpoint on this node: its images would need",
        CheckpointRefused,
    )
    message = str(failed.value)
    assert message.startswith("node-1: refusing to checkpoint on this node"), message
    assert (
        "resident in 1 process," in message and f"{tmp_path} has 50.0 MiB ({50 * MIB} bytes) free" in message
    )
    assert asked == [str(tmp_path)]
    assert shim.commands == ["status"]  # no rank was gated
    assert driver.report.outcome == "Refused"
    assert not images.exists()


async def test_a_checkpoint_that_fits_goes_on_past_preflight(
    coordinator: ThreadedCoordinator, tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _free(monkeypatch, 1 << 40)
    shim = FakeShimSocket(tmp_path / "r.ctl")
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, shim.path)
    driver = await connected_driver(coordinator, [rank])
    # the dump refuses an image dir that is not empty: the cut ran, and the rank came back
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, unwritable_images(tmp_path, [rank]), "not empty")
    assert asked == [str(tmp_path / "images")]  # the free space was looked at, and sufficed
    assert shim.commands[:3] == ["status", "quiesce", "drain"], shim.commands
    assert driver.report.outcome != "Refused"


# -- images on a tmpfs: they count in the agent's memory ---------------------------------------


def _group(root: Path, limit: str, stat: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    name = "memory.max" if "anon" in stat else "memory.limit_in_bytes"
    (root / name).write_text(limit + "\n")
    (root / "memory.stat").write_text(stat)


def test_the_agent_memory_is_read_from_its_cgroup_v1_or_v2(tmp_path: Path) -> None:
    def read(root: Path, self_cgroup: str) -> tuple[int | None, int] | None:
        group = preflight.memory_cgroup(root, self_cgroup)
        return None if group is None else (group.limit(), group.held())

    # v1, the whole hierarchy visible: the agent's group at its path under memory/
    v1 = "12:memory:/kubepods/pod1/agent\n11:cpu,cpuacct:/kubepods/pod1/agent\n0::/\n"
    _group(tmp_path / "a" / "memory" / "kubepods/pod1/agent", str(1 << 30), "cache 5\nrss 300\nshmem 20\n")
    assert read(tmp_path / "a", v1) == (1 << 30, 320)
    # v1 in a container that sees its own group at the root
    _group(tmp_path / "b" / "memory", str(1 << 30), "rss 7\nshmem 3\ntotal_rss 99\n")
    assert read(tmp_path / "b", v1) == (1 << 30, 10)
    # v1 without a limit
    _group(tmp_path / "c" / "memory", "9223372036854771712", "rss 1\n")
    assert read(tmp_path / "c", v1) == (None, 1)
    # v2, a private cgroup namespace ("0::/")
    _group(tmp_path / "d", "536870912", "anon 100\nfile 900\nshmem 50\n")
    assert read(tmp_path / "d", "0::/\n") == (536870912, 150)
    _group(tmp_path / "e", "max", "anon 100\n")
    assert read(tmp_path / "e", "0::/\n") == (None, 100)
    assert read(tmp_path / "nothing", "0::/x\n") is None


def test_a_tmpfs_is_told_from_a_disk_by_what_a_file_written_there_costs_this_process() -> None:
    """Real files, this process's real cgroup: /dev/shm is a tmpfs, the repository is on a disk."""
    group = preflight.memory_cgroup(Path("/sys/fs/cgroup"), Path("/proc/self/cgroup").read_text())
    assert group is not None, Path("/proc/self/cgroup").read_text()
    assert preflight.written_as_memory(Path("/dev/shm"), group)
    assert not preflight.written_as_memory(Path(__file__).parent, group)
    assert not list(Path("/dev/shm").glob(".ibckpt-memory-probe-*"))  # the probe is removed


def test_images_on_a_tmpfs_must_fit_in_what_the_agent_limit_leaves() -> None:
    where = Path("/var/lib/ibckpt")
    assert preflight.memory_problem(600 * MIB, 1 << 30, 424 * MIB, where) is None
    refused = preflight.memory_problem(600 * MIB, 1 << 30, 425 * MIB, where)
    assert refused == (
        f"refusing to checkpoint on this node: its images would need about 600.0 MiB ({600 * MIB} bytes) "
        "on /var/lib/ibckpt, whose files count in the agent's memory (a tmpfs), and the agent holds "
        "425.0 MiB of its 1.0 GiB limit: raise the chart's agent.resources.limits.memory or give "
        "agent.hostDir a disk (docs/node-agent.md)"
    )


def test_a_pre_dumped_checkpoint_needs_room_for_two_copies_of_its_pages(
    tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, Path("/nonexistent"))
    resident = preflight.resident_bytes(big)
    once, twice = preflight.image_estimate(resident), preflight.image_estimate(2 * resident)
    _free(monkeypatch, (once + twice) // 2)
    assert preflight.room_problem([], [rank], tmp_path) is None
    refused = preflight.room_problem([], [rank], tmp_path, pre_dumped=True)
    assert refused is not None and "in 1 process, twice (a pre-dump and the final dump)" in refused, refused


def test_on_a_tmpfs_the_agent_limit_refuses_what_the_disk_would_take(
    tmp_path: Path, big: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's cgroup is made up (its limit and use); whether the images' directory is memory is
    measured for real: /dev/shm, then the repository's disk."""
    rank = LocalRank(RankId.parse("job/rank-0/main/0"), big, Path("/nonexistent"))
    _free(monkeypatch, 1 << 40)
    monkeypatch.setattr(preflight, "resident_bytes", lambda pid: 200 * MIB if pid == big else 0)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/agent\n")
    made_up = tmp_path / "cg"
    _group(made_up / "agent", str(360 * MIB), "anon 50000000\nshmem 30000000\n")  # 284 + 76 MiB
    real = preflight.memory_cgroup(Path("/sys/fs/cgroup"), Path("/proc/self/cgroup").read_text())
    assert real is not None
    # the probe's cost is read from this process's real cgroup, the limit and use from the made-up one
    probe = preflight.written_as_memory
    monkeypatch.setattr(preflight, "written_as_memory", lambda where, _: probe(where, real))
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        refused = preflight.room_problem([], [rank], shm / "sessions", proc=proc, cgroup_root=made_up)
        assert refused is not None and f"on {shm}, whose files count in the agent's memory" in refused, (
            refused
        )
        # with room in the limit, a tmpfs is fine
        _group(made_up / "agent", str(361 * MIB), "anon 50000000\nshmem 30000000\n")
        assert preflight.room_problem([], [rank], shm / "sessions", proc=proc, cgroup_root=made_up) is None
    finally:
        shutil.rmtree(shm)
    # on a disk, the same images are the disk's business alone
    _group(made_up / "agent", str(360 * MIB), "anon 50000000\nshmem 30000000\n")
    disk = Path(__file__).parent
    assert preflight.room_problem([], [rank], disk / "nonexistent", proc=proc, cgroup_root=made_up) is None


# -- a restore's staging: the same rules, before anything is fetched ---------------------------


def _checkpoint(sizes: dict[str, int]) -> Manifest:
    """A manifest whose files are `sizes` (path -> bytes; each tree's directory and a symlink too)."""
    files = [FileRecord(path=d, kind="dir", mode=0o755) for d in sorted({p.rsplit("/", 1)[0] for p in sizes})]
    files += [
        FileRecord(
            path=p, kind="file", mode=0o600, size=n, chunks=[ChunkRef(id="ab" * 32, size=n, stored_size=1)]
        )
        for p, n in sizes.items()
    ]
    files.append(FileRecord(path="node-1/ring-0.main/link", kind="symlink", mode=0o777, target="pages-1.img"))
    return sample_manifest(files=files)


def test_a_restore_stages_the_files_of_its_containers_trees_alone() -> None:
    manifest = _checkpoint({
        "node-1/ring-0.main/pages-1.img": 300 * MIB,
        "node-1/ring-0.main/core-1.img": 5 * MIB,
        "node-1/ring-0.main2/pages-1.img": 7 * MIB,  # another tree, whose name starts alike
        "node-2/ring-1.main/pages-1.img": 200 * MIB,
    })  # fmt: skip
    assert preflight.restore_bytes(manifest.files, ["node-1/ring-0.main"]) == 305 * MIB
    assert preflight.restore_bytes(manifest.files, ["node-1/ring-0.main", "node-2/ring-1.main/"]) == 505 * MIB
    assert preflight.restore_bytes(manifest.files, ["node-3/ring-2.main"]) == 0


def test_a_restore_that_would_not_fit_on_the_disk_is_refused_and_one_that_fits_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _checkpoint(
        {"node-1/ring-0.main/pages-1.img": 1000 * MIB, "node-1/ring-1.main/pages-1.img": 0}
    )
    trees = ["node-1/ring-0.main", "node-1/ring-1.main"]
    need = preflight.image_estimate(1000 * MIB)
    staging = tmp_path / "restore"  # not made yet: the free space is asked of its parent
    asked = _free(monkeypatch, need)
    assert preflight.restore_room_problem(manifest.files, trees, staging) is None
    _free(monkeypatch, need - 1)
    refused = preflight.restore_room_problem(manifest.files, trees, staging)
    assert refused == (
        f"refusing to restore on this node: its images would need about 1.1 GiB ({need} bytes: 1000.0 MiB "
        f"in the files of 2 containers, plus 10% and 64 MiB) and {tmp_path} has 1.1 GiB ({need - 1} bytes) "
        "free: free space there or give agent.hostDir a larger disk (docs/node-agent.md)"
    )
    assert asked == [str(tmp_path)]


def test_a_restore_on_a_tmpfs_must_fit_in_what_the_agent_limit_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a checkpoint: the agent's cgroup is made up, whether /dev/shm is memory is measured."""
    assert preflight.memory_problem(600 * MIB, 1 << 30, 425 * MIB, Path("/h/restore"), "restore") == (
        f"refusing to restore on this node: its images would need about 600.0 MiB ({600 * MIB} bytes) on "
        "/h/restore, whose files count in the agent's memory (a tmpfs), and the agent holds 425.0 MiB of its "
        "1.0 GiB limit: raise the chart's agent.resources.limits.memory or give agent.hostDir a disk "
        "(docs/node-agent.md)"
    )
    _free(monkeypatch, 1 << 40)  # a container's /dev/shm may be small: the disk rule is not tested here
    manifest = _checkpoint({"node-1/ring-0.main/pages-1.img": 200 * MIB})
    need = preflight.image_estimate(200 * MIB)  # 284 MiB
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/agent\n")
    made_up = tmp_path / "cg"
    _group(made_up / "agent", str(need + 80 * MIB - 1), f"anon {60 * MIB}\nshmem {20 * MIB}\n")
    real = preflight.memory_cgroup(Path("/sys/fs/cgroup"), Path("/proc/self/cgroup").read_text())
    assert real is not None
    probe = preflight.written_as_memory
    monkeypatch.setattr(preflight, "written_as_memory", lambda where, _: probe(where, real))
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    trees = ["node-1/ring-0.main"]
    try:
        staging = shm / "restore" / "team" / "ring-0" / "main"
        refused = preflight.restore_room_problem(
            manifest.files, trees, staging, proc=proc, cgroup_root=made_up
        )
        assert refused is not None and refused.startswith(
            f"refusing to restore on this node: its images would need about 284.0 MiB ({need} bytes) on "
            f"{shm}, whose files count in the agent's memory (a tmpfs), and the agent holds 80.0 MiB of its"
        ), refused
        _group(made_up / "agent", str(need + 80 * MIB), f"anon {60 * MIB}\nshmem {20 * MIB}\n")
        assert (
            preflight.restore_room_problem(manifest.files, trees, staging, proc=proc, cgroup_root=made_up)
            is None
        )
        assert list(shm.iterdir()) == []  # the probe is gone, nothing was made
    finally:
        shutil.rmtree(shm)
    # on a disk, the disk alone decides
    _group(made_up / "agent", str(need), f"anon {60 * MIB}\n")
    disk = Path(__file__).parent / "nonexistent"
    assert preflight.restore_room_problem(manifest.files, trees, disk, proc=proc, cgroup_root=made_up) is None
