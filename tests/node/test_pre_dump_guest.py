"""A dump on a pre-dump copies again what the device wrote after the pre-dump (issue 31; docs/node-agent.md,
"Pre-dumps"). write_mem (native/tests/write_mem.c) RDMA-writes rounds of a pattern, chunk after chunk,
into an 8 MiB region its CPU never writes. The node agent pre-dumps it in rounds (each on the one
before) while it writes, then checkpoints it (Stop) on the last round and restores it; once restored it
checks that every page of the region holds what the last completed write of it put there.

The device's writes set no soft-dirty bit, so the shim marks the region at release (native/src/redirty.c)
and CRIU's account must show every page of it written again. With the mark compiled to a no-op (a first
version's atomic OR of zero, which the compiler dropped) CRIU took three quarters of the region from the
pre-dump: 560 pages written for a region of 2048."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from node.criu_stats import dump_stats

from ibckpt_native.control import ShimControl
from ibckpt_node import container_runtime
from shimtest import BUILD_DIR, SHIM, TESTS_DIR
from shimtest.harness import run_node_agent

pytestmark = pytest.mark.guest

KEY = "mem/rank-0/main/0"
CONTROL = "/run/ibckpt/mem.ctl"
REGION_PAGES = 8 * 256  # write_mem's default 8 MiB
KERNEL_FACTS = Path("/run/criu.kdat")


def wait_for(path: Path, pattern: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not re.search(pattern, text := path.read_text()):
        assert time.monotonic() < deadline, f"no {pattern!r} in {path} after {seconds} s: {text[-2000:]}"
        time.sleep(0.2)
    return text


def test_a_dump_on_a_pre_dump_keeps_what_the_device_wrote_since(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # as the agent does at start (agent/main.py): CRIU caches its kernel facts before any dump needs them
    KERNEL_FACTS.unlink(missing_ok=True)
    container_runtime.warm_criu()
    assert KERNEL_FACTS.is_file()
    Path("/run/ibckpt").mkdir(parents=True, exist_ok=True)
    checkfile, out = tmp_path / "check", tmp_path / "mem.out"
    env = {
        **os.environ,
        "LD_PRELOAD": str(SHIM),
        "IBCKPT_CTL": CONTROL,
        "IBCKPT_COORD": "unix:/run/ibckpt/coord.sock",
    }
    with open(out, "wb") as stdout, open(tmp_path / "mem.err", "wb") as stderr:
        proc = subprocess.Popen(
            [str(TESTS_DIR / "write_mem"), "-f", str(checkfile)],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, start_new_session=True,
        )  # fmt: skip
    wait_for(out, "READY", 120)
    images = tmp_path / "img"

    session, tokens = coordinator.create_session({"node-1"})
    report = run_node_agent(
        coordinator.port, session, tokens["node-1"], "checkpoint", f"--rank={KEY}={proc.pid}:{CONTROL}",
        "--images", str(images), "--mode", "Stop", "--criu-plugins", str(BUILD_DIR / "criu"),
        "--pre-dump-settle-bytes", "0",  # rounds while they shrink: the dump builds on a chain
    )  # fmt: skip
    assert report["outcome"] == "Stopped", report
    assert "PreDumped" in report["phases"], report["phases"]
    release = report["shim"]["release"][KEY]
    # every page of the region and of the source chunk, marked once no QP could write them
    assert release["redirtied_pages"] >= REGION_PAGES and release["redirty_missed_bytes"] == 0, release
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, 0)

    rank_images = images / KEY.replace("/", "_")
    parent = rank_images / "parent"
    assert parent.is_dir() and (parent / "pre-dump.log").exists(), sorted(
        p.name for p in rank_images.iterdir()
    )
    # a second round built on the first, and both travel inside the dump's images
    first = parent / "parent"
    assert first.is_dir() and not first.is_symlink() and (first / "pre-dump.log").exists(), sorted(
        p.name for p in parent.iterdir()
    )
    assert "Loaded kdat cache" in (first / "pre-dump.log").read_text()  # learnt nothing in the gate
    stats = dump_stats(rank_images)
    # the dump took pages from its pre-dump (the code and the libraries did not change) and wrote the
    # region again: the device wrote every page of it since
    assert stats["pages_skipped_parent"] > 0 and stats["pages_written"] >= REGION_PAGES, stats

    session, tokens = coordinator.create_session({"node-1"})
    report = run_node_agent(
        coordinator.port, session, tokens["node-1"], "restore", f"--rank={KEY}={rank_images}:{CONTROL}",
        "--epoch", "2",
    )  # fmt: skip
    assert report["outcome"] == "Succeeded", report
    status = ShimControl(CONTROL).status()
    assert status["state"] == "running" and status["epoch"] == 2, status
    time.sleep(2)  # writes after the restore too
    checkfile.touch()
    text = wait_for(out, "CHECK", 120)
    assert "CHECK ok" in text, text[-2000:] + (tmp_path / "mem.err").read_text()[-2000:]
    m = re.search(r"CHECK ok writes=(\d+) rounds=(\d+)", text)
    assert m and int(m.group(2)) >= 2, text[-500:]
