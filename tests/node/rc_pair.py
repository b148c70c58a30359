"""A two-rank rc_seq job over two Soft-RoCE guests, checkpointed by the node agents: shared by node tests.

Rank 0 (`ring/rank-0/main/0`, rc_seq server) starts on node 1 (10.77.0.1), rank 1 (client) on
node 2 (10.77.0.2). The shell prelude defines, on each node, `role`, `key` and:
    start_rank ARGS...     start this node's rank under the shim (extra rc_seq ARGS), pid in $pid
    agent CMD ARGS...      ibckpt-node with the coordinator, session and node name filled in
Phase scripts are formatted with `script()`; `on_both_nodes()` boots the pair and runs one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from node.a2a_job import STOP_WHEN_BOTH_READY, guest_script

from shimtest import SHIM, TESTS_DIR
from shimtest.harness import parse_result
from testbed.coordinator import guest_envs
from testbed.guest import GuestResult, GuestSpec, run_pair

PRELUDE = (
    """
set -eu
mkdir -p /run/ibckpt
start_rank() {{
  [ $role = client ] && sleep 1
  LD_PRELOAD={shim} IBCKPT_CTL=/run/ibckpt/$role.ctl IBCKPT_COORD=unix:/run/ibckpt/coord.sock \\
    setsid {rc_seq} -f {work}/stop -p 18515 $peer_args "$@" \\
    </dev/null >{work}/$role.out 2>{work}/$role.err &
  pid=$!
  for _ in $(seq 600); do grep -q READY {work}/$role.out 2>/dev/null && break; sleep 0.1; done
  grep -q READY {work}/$role.out
}}
agent() {{
  cmd=$1; shift
  {python} -m ibckpt_node.agent_cli $cmd --coordinator {addr}:{port} --session {session} \\
    --ca-file {work}/coordinator-ca.crt --node node-$IBCKPT_NODE "$@"
}}
"""
    + STOP_WHEN_BOTH_READY
    + """wait_result() {{
  for _ in $(seq 600); do grep -q RESULT {work}/$role.out 2>/dev/null && break; sleep 0.1; done
  cat {work}/$role.out
}}
"""
)

# Where each rank starts.
START = """
case $IBCKPT_NODE in
  1) role=server; key=ring/rank-0/main/0; peer_args="" ;;
  2) role=client; key=ring/rank-1/main/0; peer_args="-c 10.77.0.1" ;;
esac
"""


def pinned_binaries(work: Path) -> tuple[Path, Path]:
    """Private copies of the shim and rc_seq for this job: CRIU restores their mappings by path
    and build-ID, so a rebuild of native/ between checkpoint and restore must not reach them."""
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    pinned = bin_dir / SHIM.name, bin_dir / "rc_seq"
    # IBCKPT_TEST_SHIM: run the job under another build of the shim (a tree others rebuild)
    shim = Path(os.environ.get("IBCKPT_TEST_SHIM", str(SHIM)))
    for src, dst in zip((shim, TESTS_DIR / "rc_seq"), pinned, strict=True):
        if not dst.exists():
            shutil.copy2(src, dst)
    return pinned


def script(body: str, work: Path, port: int, session: str) -> str:
    shim, rc_seq = pinned_binaries(work)
    return guest_script(PRELUDE + body, work, port, shim=shim, rc_seq=rc_seq, session=session)


def on_both_nodes(
    coordinator: Any, work: Path, body: str, forward: tuple[int, ...] = (), timeout: float = 900
) -> tuple[GuestResult, GuestResult]:
    """Boot the pair with a fresh coordinator session for node-1 and node-2; run `body` on both."""
    session, tokens = coordinator.create_session({"node-1", "node-2"})
    text = script(body, work, coordinator.port, session)
    env_1, env_2 = guest_envs({"IBCKPT_SESSION_TOKEN": tokens})
    spec = GuestSpec(text, writable=[work], forward_ports=[coordinator.port, *forward], env=env_1)
    return run_pair(spec, dataclasses.replace(spec, env=env_2), timeout=timeout)


def diagnostics(work: Path, results: tuple[GuestResult, ...] = ()) -> str:
    files = sorted([*work.glob("*.err"), *work.glob("*.json"), *work.glob("*.out")])
    text = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in files)
    return text + "".join(f"\n--- console node-{r.node}\n{r.output[-3000:]}" for r in results)


def assert_ok(results: tuple[GuestResult, GuestResult], phase: str, work: Path) -> None:
    for r in results:
        if r.returncode != 0:
            raise AssertionError(f"{phase}: node-{r.node} exit {r.returncode}{diagnostics(work, results)}")


def assert_exactly_once(work: Path, results: tuple[GuestResult, ...] = ()) -> dict[str, dict[str, Any]]:
    """Both ranks' RESULT lines cross-match: every message delivered once, identical checksums."""
    try:
        server = parse_result((work / "server.out").read_text())
        client = parse_result((work / "client.out").read_text())
    except AssertionError as exc:
        raise AssertionError(f"{exc}{diagnostics(work, results)}") from None
    assert server["bad"] == 0 and client["bad"] == 0
    assert server["sent"] == client["received"] and client["sent"] == server["received"]
    assert server["send_sum"] == client["recv_sum"] and client["send_sum"] == server["recv_sum"]
    assert int(server["sent"]) > 0 and int(client["sent"]) > 0
    return {"server": server, "client": client}
