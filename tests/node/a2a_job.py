"""An all-to-all verbs job (native/tests/a2a_seq) over two Soft-RoCE guests, for node tests and bench.

Rank r runs as `a2a/rank-<r>/main/0` with its shim control socket at /run/ibckpt/r<r>.ctl, its
stdout/stderr in the shared work dir and its pid in <work>/r<r>.pid. The shell prelude defines:
    start_rank R        start rank R under the shim on this node
    wait_for PAT FILE S wait up to S seconds until FILE contains PAT
    rank_args KIND R... `--rank`/`--rejoin` arguments (KIND=pid: running ranks, KIND=img:<dir>: images)
    agent ...           ibckpt-node with the coordinator and this node's name filled in
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from shimtest import SHIM, TESTS_DIR
from testbed.guest import GUEST_HOST_ADDR, GuestResult
from testbed.tlsfiles import write_test_ca

A2A = TESTS_DIR / "a2a_seq"
BASE_PORT = 18600

STOP_WHEN_BOTH_READY = """
# Ends the job only once both nodes are done with their ranks (status calls and all): a rank ends
# soon after the stop file appears, so one node's stop must not race the other node's last look.
stop_when_both_ready() {{
  touch {work}/ready-to-stop-$IBCKPT_NODE
  for _ in $(seq 3000); do
    [ -e {work}/ready-to-stop-1 ] && [ -e {work}/ready-to-stop-2 ] && break; sleep 0.1
  done
  touch {work}/stop
}}
"""

PRELUDE = (
    r"""
set -eu
mkdir -p /run/ibckpt
NRANKS={nranks}
HOSTS={hosts}
start_rank() {{
  LD_PRELOAD={shim} IBCKPT_CTL=/run/ibckpt/r$1.ctl IBCKPT_COORD=unix:/run/ibckpt/coord.sock \
    setsid {a2a} -n $NRANKS -r $1 -H $HOSTS -p {base_port} -f {work}/stop -m {work}/new-objects \
    ${{A2A_EXTRA:-}} </dev/null >{work}/r$1.out 2>{work}/r$1.err &
  echo $! > {work}/r$1.pid
}}
wait_for() {{
  for _ in $(seq $(( $3 * 10 ))); do grep -q "$1" "$2" 2>/dev/null && return 0; sleep 0.1; done
  echo "timed out after $3 s waiting for '$1' in $2" >&2; return 1
}}
"""
    + STOP_WHEN_BOTH_READY
    + r"""rank_args() {{
  kind=$1; shift
  for r in "$@"; do
    key=a2a/rank-$r/main/0
    case $kind in
      pid) echo "--rank $key=$(cat {work}/r$r.pid):/run/ibckpt/r$r.ctl" ;;
      rejoin) echo "--rejoin $key=$(cat {work}/r$r.pid):/run/ibckpt/r$r.ctl" ;;
      img:*) echo "--rank $key=${{kind#img:}}/a2a_rank-${{r}}_main_0:/run/ibckpt/r$r.ctl" ;;
    esac
  done
}}
agent() {{
  cmd=$1; shift
  {python} -m ibckpt_node.agent_cli $cmd --coordinator {addr}:{port} --ca-file {work}/coordinator-ca.crt \
    --node node-$IBCKPT_NODE "$@"
}}
# A rank's control socket has refused connections for some seconds after a restore (not understood
# yet, docs/node-agent.md): retry for up to 30 s, and say when and what the rank holds meanwhile.
status_all() {{
  label=$1; shift
  for r in "$@"; do
    for try in $(seq 30); do
      {python} -m ibckpt_native.control /run/ibckpt/r$r.ctl status > {work}/status-$label-r$r.json && break
      {{ echo "$(date +%T.%N) status of rank $r refused (try $try); listeners and the rank's fds:"
        cat /proc/net/unix; ps -eo pid,ppid,stat,comm | grep -v ' ps$' || true
        for p in $(pgrep a2a_seq || true) $(cat {work}/r$r.pid); do
          head -12 /proc/$p/status || true; ls -l /proc/$p/fd /proc/$p/ns || true; done
        ls -l /proc/self/ns; tail -5 /proc/net/unix; dmesg | tail -5
      }} >> {work}/status-diag.err 2>&1
      sleep 1
    done
    [ -s {work}/status-$label-r$r.json ]
  done
}}
"""
)


def guest_script(template: str, work: Path, coordinator_port: int, **names: object) -> str:
    """`template` with the guest's work folder, the host's python, the coordinator's address and `names`
    filled in; the coordinator's CA beside it, for ibckpt-node --ca-file."""
    write_test_ca(work)
    return template.format(
        work=work, python=sys.executable, addr=GUEST_HOST_ADDR, port=coordinator_port, **names
    )


def prelude(work: Path, coordinator_port: int, hosts: list[str]) -> str:
    names = {"nranks": len(hosts), "hosts": ",".join(hosts), "shim": SHIM, "a2a": A2A, "base_port": BASE_PORT}
    return guest_script(PRELUDE, work, coordinator_port, **names)


RESULT_RE = re.compile(
    r"RESULT rank=(\d+) peer=(\d+) sent=(\d+) received=(\d+)"
    r" send_sum=([0-9a-f]+) recv_sum=([0-9a-f]+) bad=(\d+)"
)


@dataclass(frozen=True)
class Flow:
    sent: int
    received: int
    send_sum: str
    recv_sum: str
    bad: int


def diagnostics(work: Path, results: tuple[GuestResult, ...] = ()) -> str:
    files = sorted([*work.glob("*.err"), *work.glob("*.json"), *work.glob("*.out")])
    text = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in files)
    return text + "".join(f"\n--- console node-{r.node}\n{r.output[-3000:]}" for r in results)


def assert_ok(results: tuple[GuestResult, ...], phase: str, work: Path) -> None:
    for r in results:
        if r.returncode != 0:
            raise AssertionError(f"{phase}: node-{r.node} exit {r.returncode}{diagnostics(work, results)}")


def flows(work: Path, nranks: int) -> dict[tuple[int, int], Flow]:
    """(rank, peer) -> what rank sent to and received from peer, from every rank's RESULT lines."""
    out: dict[tuple[int, int], Flow] = {}
    for r in range(nranks):
        text = (work / f"r{r}.out").read_text(errors="replace")
        for m in RESULT_RE.finditer(text):
            rank, peer = int(m.group(1)), int(m.group(2))
            assert rank == r, f"r{r}.out has a RESULT of rank {rank}"
            sent, received, bad = int(m.group(3)), int(m.group(4)), int(m.group(7))
            out[(rank, peer)] = Flow(sent, received, m.group(5), m.group(6), bad)
        assert f"DONE rank={r} bad=0" in text, f"rank {r} did not finish cleanly:\n{text[-1500:]}"
    return out


def assert_exactly_once(work: Path, nranks: int) -> dict[tuple[int, int], Flow]:
    """Every ordered pair's messages arrived exactly once, in order, intact (counts and checksums)."""
    got = flows(work, nranks)
    for i in range(nranks):
        for j in range(nranks):
            if i == j:
                continue
            a, b = got[(i, j)], got[(j, i)]
            assert a.bad == 0, (i, j, a)
            assert a.sent > 0, f"rank {i} sent nothing to {j}"
            assert a.sent == b.received, f"{i}->{j}: sent {a.sent}, {j} received {b.received}"
            assert a.send_sum == b.recv_sum, f"{i}->{j}: checksum {a.send_sum} != {b.recv_sum}"
    return got


def ready_qpns(text: str) -> dict[int, int]:
    """peer -> virtual QPN of this rank's QP to it, from the READY line."""
    m = re.search(r"READY rank=\d+((?: qpn\d+=\d+)+)", text)
    assert m, f"no READY line in: {text[-1000:]}"
    return {int(p): int(q) for p, q in re.findall(r"qpn(\d+)=(\d+)", m.group(1))}
