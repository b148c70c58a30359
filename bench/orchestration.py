"""Orchestration cost of a checkpoint's phase transitions: operator -> node agents -> coordinator -> back.

Run from the repo root:  .venv/bin/python bench/orchestration.py [--quick] [--agent-processes 2]

The goals (issue 15): <= 10 ms per phase transition at 16 ranks / 2 agents, and the orchestration of
a whole 2,048-rank cut (128 agents) under 1 s. Both sizes run in one go and print side by side;
`--quick` runs the small one only.

What runs is the product's code path, on the host, with no RDMA and no CRIU, in three kinds of process:
  operator       this process: the real CoordinatorServer (the operator hosts it) with one session for
                 the job, and the operator's agent client (ibckpt.agentapi.AgentClient) POSTing a
                 CheckpointRequest to every agent over HTTPS through the operator's AgentGateway
                 (its own threads, at most 32 calls in flight) and each_agent, as QuiesceRanks does;
  node agents    real AgentServers (HTTPS API, token check against a stubbed TokenReview, container
                 registry, Sessions, the shims' coordinator proxy, NodeDriver), each with its own
                 state dir, spread over `--agent-processes` children (one event loop each); every
                 rank is a container registered the way the hook does it;
  shims          the fake shim of tests/node (its framing and its answers: every verb succeeds at
                 once), all of them served from one event loop in one more child.
A real cluster runs each agent on its own machine: here 128 agents share what is left of 2 cores, so
the 2,048-rank wall times are bounded by the agents' CPU; the CPU rows say how much each side used.

Each rank's dump is made to fail before CRIU is run (a stale file in its image dir), so a session
ends with the abort path after the cut; only the cut is measured.

A phase transition is one barrier round: from the moment the last agent finished its own part of a
phase and called the barrier until every agent has been released from it. It splits into "report"
(until the coordinator saw the last arrival) and "release" (until the last agent's barrier call
returned; the median agent's is printed too). The cut runs from the operator's first POST until every
agent has been released from `released`; its orchestration is that wall time less the time during
which some fake shim held a request: less the union of their accept-to-reply intervals (which also
counts the driver writing its request), or less only their request-read-to-reply intervals: the two
bound it. CLOCK_MONOTONIC is shared by processes, so the three kinds' times compare directly.
Barrier times come from a subclass of the coordinator client that only notes when `barrier` was
called and returned; the agents get it in place of the plain one for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agent.agent_harness import OPERATOR, Stub, register_entry
from node.fake_shim import FakeShimSocket
from pydantic import SecretStr

from ibckpt.agentapi import (
    AgentClient,
    AgentError,
    CheckpointRequest,
    Milestone,
    Mode,
    RankRef,
    SessionReport,
)
from ibckpt.coordination.client import CoordinatorClient
from ibckpt.tls import CA_FILE, client_context_from
from ibckpt_node.agent import session as agent_session
from ibckpt_node.agent.auth import Authenticator
from ibckpt_node.agent.server import AgentServer
from ibckpt_node.agent.servingcert import ServingCertificate
from ibckpt_node.registry import ContainerRegistry
from ibckpt_operator.cluster.agents import Agent, AgentGateway, each_agent
from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.tlsfiles import shared_pki

SIZES = ((2, 8), (128, 16))  # (agents, ranks per agent): 16 and 2,048 ranks
TRANSITION_GOAL_S = 0.010  # per phase transition at 16 ranks
CUT_GOAL_S = 1.0  # a whole 2,048-rank cut's orchestration
TOKEN = "op-token"  # the operator's token as the stubbed TokenReview knows it
SESSION = "ckj-bench"
JOB = "bench"

# -- the fake shims, in a child process ----------------------------------------------------------------

# Of every request, in the shims' process: (accepted, request line read, reply sent).
HELD: list[tuple[float, float, float]] = []


class LoopShim:
    """tests/node's fake shim (its answers, its framing) served from one event loop.

    FakeShimSocket runs a thread per socket and one per connection: with 2,048 ranks in one process
    those threads cost minutes of system time and a release missed its 60 s bound, which measured
    the stand-in, not the product. Each request's times are noted: from accept they also
    count the driver writing its request; from the request line read, only the shim's answer."""

    def __init__(self) -> None:
        self.state = "running"

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        # the fake shim's own replies and state moves: it reads and sets nothing but `state`
        return FakeShimSocket.answer(cast(FakeShimSocket, self), verb)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted = time.monotonic()
        line = (await reader.readline()).decode().strip()
        read = time.monotonic()
        ok, reply = self.answer(line.split()[0])
        writer.write(f"{'ok' if ok else 'err'} {json.dumps(reply)}\n".encode())
        await writer.drain()
        writer.close()
        HELD.append((accepted, read, time.monotonic()))


async def serve_shims(paths_file: Path) -> None:
    """The child: a fake shim on every path listed; 'ready', then on any input line the intervals."""
    loop = asyncio.get_running_loop()
    servers = [
        await asyncio.start_unix_server(LoopShim().serve, line) for line in paths_file.read_text().split()
    ]
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    print(json.dumps(HELD), flush=True)
    for server in servers:
        server.close()


class ShimProcess:
    def __init__(self, paths: list[Path], work: Path) -> None:
        listing = work / "shim-paths"
        listing.write_text("\n".join(map(str, paths)))
        command = [sys.executable, __file__, "--serve-shims", str(listing)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the fake shims did not start")

    def held(self) -> list[tuple[float, float, float]]:
        """Stop the shims; when each held a request."""
        out, _ = self.proc.communicate("done\n", timeout=60)
        return [(a, b, c) for a, b, c in json.loads(out)]


# -- timing ------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    # node, barrier, when called, when returned
    calls: list[tuple[str, str, float, float]] = field(default_factory=list)
    arrivals: list[tuple[str, float]] = field(default_factory=list)  # barrier, seen by the coordinator

    def arrived(self, barrier: str, _participant: str) -> None:
        self.arrivals.append((barrier, time.monotonic()))


TIMELINE = Timeline()


class TimedClient(CoordinatorClient):
    """The coordinator client, noting when each barrier was called and when it returned."""

    async def barrier(self, name: str, timeout: float) -> None:
        called = time.monotonic()
        await super().barrier(name, timeout)
        TIMELINE.calls.append((self.participant, name, called, time.monotonic()))


@contextmanager
def timed_agents() -> Iterator[None]:
    with mock.patch.object(agent_session, "CoordinatorClient", TimedClient):
        yield


# -- one run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    agents: int
    per_agent: int
    processes: int  # the agents run in this many processes
    kickoff_s: float  # the operator's POSTs to every agent
    first_post_s: float  # the first, while no session runs yet
    barriers: dict[str, tuple[float, float, float]]  # barrier -> (report, release: last, median agent) s
    cut_s: float
    shims_held_s: float  # of the cut, while some fake shim held a connection (accept to reply)
    shims_answering_s: float  # of the cut, while some fake shim answered (request read to reply)
    operator_cpu_s: float  # this process (the coordinator, the agent client) during the cut
    agents_cpu_s: float  # the agent processes, from before the first POST until every session ended

    @property
    def ranks(self) -> int:
        return self.agents * self.per_agent

    def transitions(self) -> list[float]:
        return [report + release for report, release, _ in self.barriers.values()]


def node_name(i: int) -> str:
    return f"node-{i:03d}"


def container_id(node: int, rank: int) -> str:
    return f"n{node:03d}r{rank:02d}"


def union_length(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """How long at least one interval covered, within [start, end]."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def make_agent(state: Path, node: str) -> AgentServer:
    return AgentServer(
        node=node,
        host="127.0.0.1",
        port=0,
        registry=ContainerRegistry(state),
        authenticator=Authenticator(Stub(), frozenset({OPERATOR})),
        tls=ServingCertificate(state.parent / "agent-tls").context,  # the run's (run() makes it)
        coordinator_tls=lambda: client_context_from(state.parent / "agent-tls" / CA_FILE),
        work_dir=state,
        shim_path=str(state / "lib" / "libibckpt.so"),
    )


def prepare_ranks(state: Path, node: int, per_agent: int) -> list[Path]:
    """Each rank a container of its own: its control socket's path, and a dump that fails at once."""
    paths = []
    for r in range(per_agent):
        cid = container_id(node, r)
        ctl = state / "containers" / cid / "ctl"
        ctl.mkdir(parents=True)
        paths.append(ctl / "1.sock")
        stale = state / "sessions" / SESSION / "images" / f"pod-{cid}.main"
        stale.mkdir(parents=True)
        (stale / "stale").write_text("the dump refuses a dir that is not empty: no CRIU is run\n")
    return paths


def request_for(node: int, per_agent: int, port: int, token: str) -> CheckpointRequest:
    return CheckpointRequest(
        session_id=SESSION,
        coordinator=f"127.0.0.1:{port}",
        session_token=SecretStr(token),
        job=JOB,
        ranks=[RankRef(pod_uid=f"uid-{container_id(node, r)}", container="main") for r in range(per_agent)],
        job_addresses=["127.0.0.1"],
        # Hold, whose dump starts once every node has passed `released`: a LeaveRunning node meets that
        # barrier during its dump, and a dump that fails at once (the stale file) could abort the session
        # before the barrier passed everywhere, so that the cut measured would not be whole.
        mode=Mode.HOLD,
    )


class TimedAgentClient(AgentClient):
    """The operator's agent client, noting how long each POST took on its thread (not its wait for one)."""

    took: ClassVar[dict[int, float]] = {}

    def checkpoint(self, request: CheckpointRequest) -> SessionReport:
        started = time.monotonic()
        try:
            return super().checkpoint(request)
        finally:
            self.took[self.port] = time.monotonic() - started


class BenchGateway(AgentGateway):
    """The operator's gateway (its threads, its bound on calls in flight); only the port is per agent."""

    def __init__(self, ports: dict[str, int], tls_dir: Path) -> None:
        super().__init__(client_context_from(tls_dir / CA_FILE), token=TOKEN)
        self.ports = ports

    def client(self, agent: Agent) -> AgentClient:
        return TimedAgentClient(agent.host, self.ports[agent.node], tls=self.tls, token=TOKEN, timeout_s=30)


async def kick_off(ports: list[int], requests: list[CheckpointRequest], tls_dir: Path) -> list[float]:
    """The operator's QuiesceRanks: one POST per node agent through its gateway, all at once
    (each_agent). Seconds per POST."""
    nodes = [node_name(i) for i in range(len(ports))]
    gateway = BenchGateway(dict(zip(nodes, ports, strict=True)), tls_dir)
    TimedAgentClient.took.clear()
    calls = [
        gateway.checkpoint(Agent(node, node, "127.0.0.1", True), r)
        for node, r in zip(nodes, requests, strict=True)
    ]
    failed = [str(o) for o in await each_agent(calls) if isinstance(o, AgentError)]
    if failed:
        raise RuntimeError("; ".join(failed[:5]))
    return [TimedAgentClient.took[port] for port in ports]


def session_over(agent: AgentServer) -> bool:
    session = agent.sessions.sessions.get(SESSION)
    return session is not None and session.report.state.finished


def problems_of(agents: list[AgentServer]) -> list[str]:
    """Every agent passed the cut and then failed the dump on the stale file, as arranged; or why not."""
    found = []
    for agent in agents:
        report = agent.sessions.get(SESSION)
        if Milestone.RELEASED not in report.phases or "not empty" not in report.message:
            found.append(f"{agent.node}: unexpected session: {report.state} {report.message}")
    return found


def register_all(states: dict[int, Path], per_agent: int, pid: int) -> None:
    """Each rank's container, registered with its agent as ibckpt-hook does."""
    for i, state in states.items():
        for r in range(per_agent):
            register_entry(state, pid, container_id(i, r))


async def serve_agents(first: int, count: int, per_agent: int, work: Path, rank_pid: int) -> None:
    """A child: agents first..first+count-1 on one event loop. Prints their ports once their ranks
    are registered, then, once every one's session is over, its barrier times and any problem."""
    states = {i: work / f"a{i:03d}" for i in range(first, first + count)}
    agents = [make_agent(state, node_name(i)) for i, state in states.items()]
    for agent in agents:
        await agent.start()
    await asyncio.to_thread(register_all, states, per_agent, rank_pid)
    cpu = time.process_time()
    print(json.dumps([a.http.port for a in agents]), flush=True)
    with timed_agents():
        while not all(session_over(a) for a in agents):
            await asyncio.sleep(0.05)
    cpu = time.process_time() - cpu  # from the ports printed: the sessions, and 20 polls a second
    print(json.dumps({"calls": TIMELINE.calls, "problems": problems_of(agents), "cpu": cpu}), flush=True)
    for agent in agents:
        await agent.close()


class AgentProcess:
    def __init__(self, first: int, count: int, per_agent: int, work: Path, rank_pid: int) -> None:
        args = [str(v) for v in (first, count, per_agent, work, rank_pid)]
        command = [sys.executable, __file__, "--serve-agents", *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"agent process for agents {first}..{first + count - 1} did not start")
        self.ports: list[int] = json.loads(line)

    def result(self) -> dict[str, Any]:
        """The child's barrier times, problems and CPU seconds, once its sessions are over."""
        line = self.stdout.readline()
        self.proc.wait(60)
        if not line:
            raise RuntimeError(f"an agent process ended with {self.proc.returncode} and no result")
        result: dict[str, Any] = json.loads(line)
        return result


def split(agents: int, processes: int) -> list[tuple[int, int]]:
    """(first, count) of each agent process, as even as can be."""
    processes = min(processes, agents)
    bounds = [agents * p // processes for p in range(processes + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


def barrier_times(start: float) -> tuple[dict[str, tuple[float, float, float]], float]:
    """Per barrier (in the order passed): (report, release to the last agent, to the median agent)
    seconds; and when Released was left."""
    names = list(dict.fromkeys(name for _, name, _, _ in sorted(TIMELINE.calls, key=lambda c: c[2])))
    cut = names[: names.index(Milestone.RELEASED) + 1]
    times = {}
    for name in cut:
        last_called = max(c[2] for c in TIMELINE.calls if c[1] == name)
        last_returned = max(c[3] for c in TIMELINE.calls if c[1] == name)
        last_seen = max(t for b, t in TIMELINE.arrivals if b == name)
        releases = sorted(c[3] - last_seen for c in TIMELINE.calls if c[1] == name)
        times[name] = (last_seen - last_called, last_returned - last_seen, releases[len(releases) // 2])
    released = max(c[3] for c in TIMELINE.calls if c[1] == Milestone.RELEASED)
    return times, released - start


async def run(agents_n: int, per_agent: int, processes: int, work: Path, rank_pid: int) -> Run:
    TIMELINE.calls.clear()
    TIMELINE.arrivals.clear()
    pki = shared_pki()  # the agents, in child processes, read its CA and certificate from work/agent-tls
    pki.agent_dir(work / "agent-tls")
    coordinator = CoordinatorServer(pki.coordinator())
    await coordinator.start()
    paths = [p for i in range(agents_n) for p in prepare_ranks(work / f"a{i:03d}", i, per_agent)]
    shims = ShimProcess(paths, work)
    children = [AgentProcess(first, n, per_agent, work, rank_pid) for first, n in split(agents_n, processes)]
    try:
        session, tokens = coordinator.create_session({node_name(i) for i in range(agents_n)}, 600, SESSION)
        coordinator.sessions[session].arrival_listeners.append(TIMELINE.arrived)
        requests = [
            request_for(i, per_agent, coordinator.port, tokens[node_name(i)]) for i in range(agents_n)
        ]
        ports = [port for child in children for port in child.ports]
        cpu, start = time.process_time(), time.monotonic()
        posts = await kick_off(ports, requests, work / "agent-tls")
        kicked = time.monotonic()
        results = await asyncio.gather(*(asyncio.to_thread(child.result) for child in children))
        cpu = time.process_time() - cpu
    finally:
        held = shims.held()
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
        await coordinator.stop()
    problems = [p for result in results for p in result["problems"]]
    if problems:
        raise RuntimeError("; ".join(problems[:5]))
    TIMELINE.calls[:] = [(a, b, c, d) for result in results for a, b, c, d in result["calls"]]
    barriers, cut = barrier_times(start)
    end = start + cut
    held_s = union_length([(a, c) for a, _, c in held], start, end)
    answering_s = union_length([(b, c) for _, b, c in held], start, end)
    agents_cpu = sum(result["cpu"] for result in results)
    return Run(
        agents_n, per_agent, len(children), kicked - start, posts[0], barriers, cut, held_s, answering_s,
        cpu, agents_cpu,
    )  # fmt: skip


# -- the table ---------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def print_table(runs: list[Run]) -> None:
    label_width = 42
    heads = [f"{r.ranks} ranks / {r.agents} agents in {r.processes}" for r in runs]
    width = max(len(h) for h in heads) + 2
    print(f"{'ms':<{label_width}}" + "".join(f"{h:>{width}}" for h in heads))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:<{label_width}}" + "".join(f"{v:>{width}}" for v in values))

    print("(a transition: report + release to the last agent; in brackets, the release to the median one)")
    row("operator POSTs to every agent, at once", [ms(r.kickoff_s) for r in runs])
    row(
        "  the first POST / the mean POST",
        [f"{ms(r.first_post_s)} / {ms(r.kickoff_s / r.agents)}" for r in runs],
    )
    for name in runs[0].barriers:
        row(f"transition '{name}'", [barrier_cell(r, name) for r in runs])
    row("mean transition", [ms(sum(r.transitions()) / len(r.transitions())) for r in runs])
    row("cut: first POST .. last released", [ms(r.cut_s) for r in runs])
    row("  a fake shim held a connection", [ms(r.shims_held_s) for r in runs])
    row("  a fake shim answered a request", [ms(r.shims_answering_s) for r in runs])
    row("  orchestration: cut less shims", [orchestration_cell(r) for r in runs])
    row("CPU: operator (coordinator, client)", [ms(r.operator_cpu_s) for r in runs])
    row("CPU: agent processes, whole sessions", [ms(r.agents_cpu_s) for r in runs])
    row("  per agent", [ms(r.agents_cpu_s / r.agents) for r in runs])


def orchestration_cell(run: Run) -> str:
    """Between the cut less every moment a shim held a connection, and less only its answers."""
    return f"{ms(run.cut_s - run.shims_held_s)}..{ms(run.cut_s - run.shims_answering_s)}"


def barrier_cell(run: Run, name: str) -> str:
    if name not in run.barriers:
        return "-"
    report, release, median = run.barriers[name]
    return f"{ms(report + release)} ({ms(report)}+{ms(release)}; {ms(median)})"


def print_ratios(runs: list[Run]) -> None:
    small = runs[0]
    worst = max(small.transitions())
    print(f"\nslowest transition at {small.ranks} ranks / goal {ms(TRANSITION_GOAL_S)} ms: "
          f"{worst / TRANSITION_GOAL_S:.2f}")  # fmt: skip
    for r in runs[1:]:
        print(f"operator process CPU for the {r.ranks}-rank cut / goal {CUT_GOAL_S * 1000:.0f} ms: "
              f"{r.operator_cpu_s / CUT_GOAL_S:.2f}")  # fmt: skip
        low, high = r.cut_s - r.shims_held_s, r.cut_s - r.shims_answering_s
        print(f"cut orchestration at {r.ranks} ranks / goal {CUT_GOAL_S * 1000:.0f} ms: "
              f"{low / CUT_GOAL_S:.2f}..{high / CUT_GOAL_S:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 ranks / 2 agents only")
    parser.add_argument("--size", action="append", help="AGENTSxRANKS_PER_AGENT instead of the goals' sizes")
    parser.add_argument(
        "--agent-processes", type=int, default=2, help="processes the agents are spread over (default 2)"
    )
    parser.add_argument("--serve-shims", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-agents", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every session ends on the arranged dump failure: not news
    if args.serve_shims:
        asyncio.run(serve_shims(args.serve_shims))
        return 0
    if args.serve_agents:
        first, count, per_agent, work_dir, rank_pid = args.serve_agents
        asyncio.run(serve_agents(int(first), int(count), int(per_agent), Path(work_dir), int(rank_pid)))
        return 0
    sizes: tuple[tuple[int, int], ...] = SIZES[:1] if args.quick else SIZES
    if args.size:
        sizes = tuple((int(a), int(r)) for a, _, r in (size.partition("x") for size in args.size))
    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-orch-"))
    sleeper = subprocess.Popen(["sleep", "3600"])  # every rank's process: no device, no TCP
    runs = []
    try:
        for agents_n, per_agent in sizes:
            size_dir = work / f"{agents_n}x{per_agent}"
            size_dir.mkdir()
            runs.append(asyncio.run(run(agents_n, per_agent, args.agent_processes, size_dir, sleeper.pid)))
    finally:
        sleeper.kill()
        sleeper.wait()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"checkpoint cut through the agent API, fake shims, no CRIU; load average {load[0]:.1f}\n")
    print_table(runs)
    print_ratios(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
