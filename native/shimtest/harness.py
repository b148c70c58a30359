"""Run programs under libibckpt and checkpoint them: the test and bench driver.

A checkpoint of a set of processes is quiesce -> drain -> release (all) ->
optional CRIU dump -> rebuild (all, in parallel: each waits for its peers'
records at the coordinator) -> resume (all).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ibckpt_native.control import ControlError, ShimControl
from ibckpt_node.procfs import device_fds_and_maps

from . import SHIM


@dataclass
class ShimProc:
    """One program started under the shim, detached from any tty."""

    name: str
    argv: Sequence[str]
    workdir: Path
    env: dict[str, str]
    shim: Path = SHIM
    popen: subprocess.Popen[bytes] | None = None
    ctl_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ctl_path = self.workdir / f"{self.name}.ctl"

    @property
    def out(self) -> Path:
        return self.workdir / f"{self.name}.out"

    @property
    def err(self) -> Path:
        return self.workdir / f"{self.name}.err"

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        env["LD_PRELOAD"] = str(self.shim)
        if "asan" in self.shim.name:
            # the ASan runtime must be the first object in the process
            libasan = subprocess.run(
                ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
            ).stdout.strip()
            env["LD_PRELOAD"] = f"{libasan} {self.shim}"
            env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")
        env["IBCKPT_CTL"] = str(self.ctl_path)
        with self.out.open("wb") as out, self.err.open("wb") as err:
            # setsid and no tty: CRIU cannot dump a task on the serial console.
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                cwd=self.workdir,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def ctl(self) -> ShimControl:
        return ShimControl(str(self.ctl_path))

    def wait_for_output(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.out.read_text(errors="replace"))
            if m:
                return m
            if self.popen is not None and self.popen.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.err.read_text(errors="replace")[-2000:]
        raise TimeoutError(f"{self.name}: no {pattern!r}; stderr: {tail}")

    def wait_connected(self, timeout: float) -> None:
        """Until the shim reports every QP of the process in RTR or RTS (no need to read stdout,
        which unmodified programs buffer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                break
            if self.ctl_path.exists():
                try:
                    qps = self.ctl.status().get("qps", [])
                except OSError as exc:
                    raise RuntimeError(f"{self.name}: control socket: {exc}; {self.outputs()}") from exc
                # RTR is enough: a side that only receives (perftest's send_bw server) stops there
                if qps and all(q["state"] in (2, 3) for q in qps):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: QPs never connected; {self.outputs()}")

    def outputs(self) -> str:
        alive = self.popen is not None and self.popen.poll() is None
        return (
            f"{'running' if alive else 'exited'}; stdout: {self.out.read_text(errors='replace')[-1500:]}"
            f"; stderr: {self.err.read_text(errors='replace')[-1500:]}"
        )

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def start_server_then_client(server: ShimProc, client: ShimProc) -> None:
    """Start the server, then the client once the server's control socket exists: it appears at
    ibv_open_device, just before the server listens."""
    server.start()
    deadline = time.monotonic() + 60
    while not server.ctl_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    client.start()


def sends_completed(prog: ShimProc) -> int:
    """The sends completed on all of prog's QPs, from its status."""
    return sum(int(q["sends_completed"]) for q in prog.ctl.status()["qps"])


def wait_traffic(procs: Sequence[ShimProc], more: int, timeout: float = 180) -> None:
    """Wait until each of procs has completed `more` sends beyond what it had on entry."""
    start = [sends_completed(p) for p in procs]
    deadline = time.monotonic() + timeout
    while any(sends_completed(p) < s + more for p, s in zip(procs, start, strict=True)):
        assert time.monotonic() < deadline, [p.outputs() for p in procs]
        time.sleep(0.2)


@dataclass
class CheckpointResult:
    epoch: int
    reports: dict[str, dict[str, dict[str, Any]]]
    released_state: dict[str, tuple[int, int]]
    criu_rc: int | None = None
    criu_log: str = ""


def _each(procs: Sequence[ShimProc], fn: Callable[[ShimProc], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=len(procs)) as pool:
        futures = [(p, pool.submit(fn, p)) for p in procs]
        results = {}
        for p, f in futures:
            try:
                results[p.name] = f.result()
            except (ControlError, OSError) as exc:
                # a process that died mid-phase says why on its stderr (a sanitizer, an abort)
                raise RuntimeError(f"{p.name}: {exc}; {p.outputs()}") from exc
        return results


def criu_dump(pid: int, images: Path) -> tuple[int, str]:
    images.mkdir(parents=True, exist_ok=True)
    cmd = ["criu", "dump", "-t", str(pid), "-D", str(images), "--leave-running", "-o", "dump.log", "-v4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = (images / "dump.log").read_text(errors="replace") if (images / "dump.log").exists() else ""
    return proc.returncode, proc.stdout + proc.stderr + log[-4000:]


def checkpoint(
    procs: Sequence[ShimProc],
    epoch: int,
    *,
    dump: ShimProc | None = None,
    images: Path | None = None,
    drain_ms: int = 3000,
) -> CheckpointResult:
    reports: dict[str, dict[str, dict[str, Any]]] = {}
    reports["quiesce"] = _each(procs, lambda p: p.ctl.quiesce(20000))
    reports["drain"] = _each(procs, lambda p: p.ctl.drain(drain_ms))
    reports["release"] = _each(procs, lambda p: p.ctl.release(10000))
    state = {p.name: device_fds_and_maps(p.pid) for p in procs}
    result = CheckpointResult(epoch, reports, state)
    if dump is not None:
        assert images is not None
        result.criu_rc, result.criu_log = criu_dump(dump.pid, images)
    reports["rebuild"] = _each(procs, lambda p: p.ctl.rebuild(epoch, 60000))
    reports["resume"] = _each(procs, lambda p: p.ctl.resume())
    return result


def checkpoint_loop(
    procs: Sequence[ShimProc],
    count: int,
    *,
    seed: int = 1,
    min_gap: float = 0.02,
    max_gap: float = 0.3,
    dump_at: Sequence[int] = (),
    images: Path | None = None,
) -> list[CheckpointResult]:
    """`count` checkpoints at random moments; CRIU-dump procs[0] at the given indices."""
    rng = random.Random(seed)
    results = []
    for i in range(count):
        time.sleep(rng.uniform(min_gap, max_gap))
        dump = procs[0] if i in dump_at else None
        img = images / f"ckpt{i}" if (images is not None and dump is not None) else None
        results.append(checkpoint(procs, i + 1, dump=dump, images=img))
    return results


RESULT_RE = re.compile(
    r"RESULT sent=(\d+) received=(\d+) send_sum=([0-9a-f]+) recv_sum=([0-9a-f]+) events=(\d+) bad=(\d+)"
)


def parse_result(text: str) -> dict[str, int | str]:
    m = RESULT_RE.search(text)
    if not m:
        raise AssertionError(f"no RESULT line in: {text[-2000:]}")
    return {
        "sent": int(m.group(1)),
        "received": int(m.group(2)),
        "send_sum": m.group(3),
        "recv_sum": m.group(4),
        "events": int(m.group(5)),
        "bad": int(m.group(6)),
    }


def parse_fields(text: str) -> dict[str, str]:
    """All key=value fields of the last RESULT line (verbs_seq prints mode-specific ones)."""
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise AssertionError(f"no RESULT line in: {text[-2000:]}")
    return dict(field.split("=", 1) for field in lines[-1].split()[1:] if "=" in field)


def run_node_agent(coordinator_port: int, session: str, token: str, *args: str) -> dict[str, Any]:
    """The node agent's command line (ibckpt_node.agent_cli ARGS) as node-1 of a coordinator session
    on 127.0.0.1, with the shims' coordinator at /run/ibckpt/coord.sock: it must succeed, and its
    JSON report is returned. For the guest tests that drive a whole node checkpoint or restore."""
    from testbed.tlsfiles import write_test_ca  # the coordinator fixture's CA (it serves TLS only)

    ca = write_test_ca(Path(tempfile.mkdtemp(prefix="ibckpt-ca-")))
    where = ["--coordinator", f"127.0.0.1:{coordinator_port}", "--session", session, "--node", "node-1",
             "--shim-socket", "/run/ibckpt/coord.sock", "--ca-file", str(ca)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "ibckpt_node.agent_cli", *args, *where],
        env={**os.environ, "IBCKPT_SESSION_TOKEN": token}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report: dict[str, Any] = json.loads(run.stdout)
    return report
