"""pytest plugin: tests marked `guest` run inside ONE booted Soft-RoCE guest per session.

On the host, each guest-marked test is replaced by a stand-in item. The first time one
is needed (it starts in the background as soon as collection ends), a single guest is
booted that runs pytest on exactly those node ids and writes a JSON report into a shared
directory. Each stand-in then reports its test's outcome, output and failure text, so
guest tests appear in the host's report like any other test.

Inside the guest (IBCKPT_GUEST=1) the same plugin only records outcomes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed import guest as guest_vm

IN_GUEST = os.environ.get("IBCKPT_GUEST") == "1"
REPORT_OPTION = "--guest-report"
RUNNING_FILE = "running"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(REPORT_OPTION, default=None, help="(inside the guest) write outcomes to this JSON file")
    parser.addoption("--guest-timeout", type=float, default=3600.0, help="bound on the whole in-guest run")


# ---- inside the guest: record outcomes -------------------------------------------------


class _Recorder:
    """Writes the outcomes after every test, so a guest lost mid-run still tells which ran."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.path.with_name(RUNNING_FILE).write_text(nodeid)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(
            report.nodeid, {"outcome": "passed", "longrepr": "", "sections": [], "duration": 0.0}
        )
        entry["duration"] += report.duration
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["longrepr"] += f"[{report.when}] {report.longreprtext}\n"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["longrepr"] = report.longreprtext
        entry["sections"] += [[f"{name} ({report.when}, in guest)", text] for name, text in report.sections]
        if report.when == "teardown":
            self._write()

    @pytest.hookimpl
    def pytest_sessionfinish(self) -> None:
        self._write()

    def _write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.results))
        partial.replace(self.path)


# ---- on the host: one guest run, stand-in items ----------------------------------------


class GuestRun:
    """The single in-guest pytest run of this session, started once in a thread."""

    def __init__(self, nodeids: list[str], rootdir: Path, timeout: float) -> None:
        self.nodeids = nodeids
        self.rootdir = rootdir
        self.timeout = timeout
        self.results: dict[str, dict[str, Any]] = {}
        self.failure: str | None = None
        self.console = ""
        # Why each fresh guest was booted: the guests lost before it, in order.
        self.restarts: list[str] = []
        self._thread = threading.Thread(target=self._run, name="guest-pytest", daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def wait(self) -> None:
        self.start()
        self._thread.join()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        for attempt in (1, 2):
            pending = [nodeid for nodeid in self.nodeids if nodeid not in self.results]
            lockup = self._run_guest(pending, deadline, attempt)
            if lockup is None or attempt == 2 or self.failure is not None:
                return
            # The testbed failed, not the tests: what had not reported runs again in a fresh guest,
            # the test that was running included, and each of them says so in its report.
            self.restarts.append(lockup)
            self.console = ""

    def _run_guest(self, nodeids: list[str], deadline: float, attempt: int) -> str | None:
        """One guest runs `nodeids`; returns why it was lost to a kernel lockup, else None."""
        with tempfile.TemporaryDirectory(prefix="ibckpt-guest-pytest-") as tmp:
            shared = Path(tmp)
            (shared / "args").write_text("\n".join(nodeids) + "\n")
            report = shared / "report.json"
            command = (
                f"exec {sys.executable} -m pytest -p no:cacheprovider "
                f"{REPORT_OPTION}={report} -o addopts= -q -rN @{shared / 'args'}"
            )
            spec = guest_vm.GuestSpec(command, writable=[shared], cwd=self.rootdir)
            try:
                result = guest_vm.run(spec, timeout=max(60.0, deadline - time.monotonic()))
            except Exception as exc:  # boot failures must fail the tests, not hang them
                self.failure = f"guest could not run: {exc!r}"
                return None
            self.console = result.output
            reported: dict[str, dict[str, Any]] = json.loads(report.read_text()) if report.exists() else {}
            for entry in reported.values():
                entry["attempt"] = attempt
            self.results.update(reported)
            running = shared / RUNNING_FILE
            if result.lockup is not None:
                during = running.read_text() if running.exists() else "(before the first test)"
                return f"the guest's kernel locked up while {during} ran: {result.lockup}"
            if not reported:
                self.failure = (
                    f"in-guest pytest gave no report (exit {result.returncode}); console tail:\n"
                    + "\n".join(result.output.splitlines()[-60:])
                )
            return None


class GuestStandIn(pytest.Item):
    """Reports the outcome of the same test, run in the guest."""

    def __init__(self, *, guest_run: GuestRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guest_run = guest_run

    def runtest(self) -> None:
        self.guest_run.wait()
        entry = self.guest_run.results.get(self.nodeid)
        if entry is None:
            if self.guest_run.failure:
                pytest.fail(self.guest_run.failure, pytrace=False)
            lost = "; ".join(self.guest_run.restarts) or "crashed or timed out before it"
            tail = "\n".join(self.guest_run.console.splitlines()[-40:])
            pytest.fail(f"test did not run in the guest ({lost}); console tail:\n{tail}", pytrace=False)
        if entry["attempt"] > 1:
            restarts = "; ".join(self.guest_run.restarts)
            self.add_report_section("call", "guest", f"--- run in a fresh guest, as {restarts}")
        for title, text in entry["sections"]:
            self.add_report_section("call", "guest", f"--- {title}\n{text}")
        if entry["outcome"] == "skipped":
            pytest.skip(f"(in guest) {entry['longrepr']}")
        if entry["outcome"] != "passed":
            pytest.fail(f"(in guest, {entry['outcome']})\n{entry['longrepr']}", pytrace=False)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"[guest] {self.name}"


def pytest_configure(config: pytest.Config) -> None:
    report = config.getoption(REPORT_OPTION)
    if IN_GUEST and report:
        config.pluginmanager.register(_Recorder(Path(report)), "guest-recorder")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if IN_GUEST:
        return
    guest_items = [i for i in items if i.get_closest_marker("guest")]
    if not guest_items:
        return
    run = GuestRun(
        [i.nodeid for i in guest_items], Path(str(config.rootpath)), config.getoption("--guest-timeout")
    )
    for index, item in enumerate(items):
        if item.get_closest_marker("guest"):
            assert item.parent is not None
            stand_in = GuestStandIn.from_parent(item.parent, name=item.name, guest_run=run)
            stand_in.own_markers = list(item.own_markers)
            # The first stand-in waits for the whole guest run: pytest-timeout must allow for it.
            stand_in.add_marker(pytest.mark.timeout(run.timeout + 120))
            items[index] = stand_in
    config.stash[_RUN_KEY] = run


_RUN_KEY = pytest.StashKey[GuestRun]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The in-guest durations, which --durations cannot see: it times the stand-ins, and the first one
    waits for the whole guest run."""
    run = config.stash.get(_RUN_KEY, None)
    if run is None:
        return
    for why in run.restarts:
        terminalreporter.write_line(f"in-guest run: a fresh guest ran the rest, as {why}")
    if not run.results:
        return
    slowest = sorted(run.results.items(), key=lambda kv: -float(kv[1]["duration"]))[:15]
    total = sum(float(entry["duration"]) for entry in run.results.values())
    terminalreporter.write_sep("=", f"slowest in-guest tests (all {len(run.results)}: {total:.0f}s)")
    for nodeid, entry in slowest:
        terminalreporter.write_line(f"{float(entry['duration']):8.2f}s {entry['outcome']:7} {nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    # Boot the guest while the host-side tests run: it is the long pole.
    run = session.config.stash.get(_RUN_KEY, None)
    if run is not None and not session.config.option.collectonly:
        run.start()
    yield
