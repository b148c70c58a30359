"""A two-rank verbs job moves across nodes: checkpoint on A and B, restore each rank on the OTHER node.

Rank 0 (rc_seq server) starts on node A and rank 1 (rc_seq client) on node B, exchanging
sequence-numbered, checksummed messages both ways over RC. Mid-traffic, each node's agent
runs a Stop checkpoint through the job coordinator on the host (quiesce, drain, release,
CRIU dump into a shared dir) and both guests power off. Two fresh guests then boot with the
roles swapped: rank 0 is restored on node B and rank 1 on node A, so every GID and QPN is
new; they rebuild through the coordinator, resume, and must finish with every message
delivered exactly once and matching checksums.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ibckpt_native import SHIM, TESTS_DIR
from ibckpt_native.harness import parse_result
from testbed.guest import GUEST_HOST_ADDR, GuestResult, GuestSpec, run_pair

pytestmark = pytest.mark.twoguests

RANKS = {
    # rank key: (role, node it starts on, node it is restored on, extra rc_seq args)
    "ring/rank-0/main/0": ("server", 1, 2, ""),
    "ring/rank-1/main/0": ("client", 2, 1, "-c 10.77.0.1"),
}

PHASE1 = """
set -eu
mkdir -p /run/ibckpt
# Push the pid counter up: phase 2's agent must not take the ranks' (and their threads') pids.
for _ in $(seq 300); do /bin/true; done
case $IBCKPT_NODE in
  1) role=server; key=ring/rank-0/main/0; peer_args="" ;;
  2) role=client; key=ring/rank-1/main/0; peer_args="-c 10.77.0.1" ;;
esac
[ $role = client ] && sleep 1
LD_PRELOAD={shim} IBCKPT_CTL=/run/ibckpt/$role.ctl IBCKPT_COORD=unix:/run/ibckpt/coord.sock \
  setsid {rc_seq} -f {work}/stop -p 18515 $peer_args \
  </dev/null >{work}/$role.out 2>{work}/$role.err &
pid=$!
for _ in $(seq 600); do grep -q READY {work}/$role.out 2>/dev/null && break; sleep 0.1; done
grep -q READY {work}/$role.out
sleep 3  # traffic in flight when the checkpoint starts
{python} -m ibckpt_node.agent_cli checkpoint --coordinator {addr}:{port} --session {session} \
  --node node-$IBCKPT_NODE --rank "$key=$pid:/run/ibckpt/$role.ctl" --images {work}/images --mode Stop \
  > {work}/ckpt-node-$IBCKPT_NODE.json
echo "checkpointed $key from pid $pid"
"""

PHASE2 = """
set -eu
mkdir -p /run/ibckpt
case $IBCKPT_NODE in
  2) role=server; key=ring/rank-0/main/0 ;;   # rank 0 moves from node A to node B
  1) role=client; key=ring/rank-1/main/0 ;;   # rank 1 moves from node B to node A
esac
images={work}/images/$(echo $key | tr / _)
{python} -m ibckpt_node.agent_cli restore --coordinator {addr}:{port} --session {session} \
  --node node-$IBCKPT_NODE --rank "$key=$images:/run/ibckpt/$role.ctl" --epoch 2 \
  > {work}/restore-node-$IBCKPT_NODE.json
pid=$({python} -c "import json,sys; print(json.load(open(sys.argv[1]))['restored_pids'][sys.argv[2]])" \
  {work}/restore-node-$IBCKPT_NODE.json $key)
echo "restored $key as pid $pid on node-$IBCKPT_NODE"
sleep 3  # traffic after the move
{python} -m ibckpt_native.control /run/ibckpt/$role.ctl status > {work}/status-$role.json || true
touch {work}/stop
for _ in $(seq 600); do grep -q RESULT {work}/$role.out 2>/dev/null && break; sleep 0.1; done
cat {work}/$role.out
"""


def _assert_ok(results: tuple[GuestResult, GuestResult], phase: str, work: Path) -> None:
    for r in results:
        if r.returncode != 0:
            logs = "".join(
                f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(work.glob("*.err"))
            )
            raise AssertionError(f"{phase}: node-{r.node} exit {r.returncode}\n{r.output[-4000:]}{logs}")


def test_two_ranks_checkpointed_and_restored_on_the_other_nodes(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    common = {
        "shim": SHIM,
        "rc_seq": TESTS_DIR / "rc_seq",
        "work": work,
        "python": sys.executable,
        "addr": GUEST_HOST_ADDR,
        "port": coordinator.port,
    }

    def on_both_nodes(template: str) -> tuple[GuestResult, GuestResult]:
        session, token = coordinator.create_session({"node-1", "node-2"})
        script = template.format(session=session, **common)
        env = {"IBCKPT_SESSION_TOKEN": token}
        specs = [GuestSpec(script, writable=[work], forward_ports=[coordinator.port], env=env) for _ in "AB"]
        return run_pair(*specs, timeout=900)

    _assert_ok(on_both_nodes(PHASE1), "checkpoint", work)
    for key in RANKS:
        assert (work / "images" / key.replace("/", "_") / "dump.log").exists()
    assert not (work / "stop").exists()
    before = {role: (work / f"{role}.out").read_text() for role in ("server", "client")}
    assert all("RESULT" not in text for text in before.values()), "the job ended before the checkpoint"

    restored = on_both_nodes(PHASE2)
    _assert_ok(restored, "restore", work)
    assert re.search(r"restored ring/rank-0/main/0 as pid \d+ on node-2", restored[1].output)
    assert re.search(r"restored ring/rank-1/main/0 as pid \d+ on node-1", restored[0].output)

    diagnostics = "".join(
        f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
        for p in sorted([*work.glob("*.err"), *work.glob("*.json"), *work.glob("*.out")])
    ) + "".join(f"\n--- console node-{r.node}\n{r.output[-2000:]}" for r in restored)
    try:
        server = parse_result((work / "server.out").read_text())
        client = parse_result((work / "client.out").read_text())
    except AssertionError as exc:
        raise AssertionError(f"{exc}{diagnostics}") from None
    # Exactly once, both directions, identical data: counts and checksums cross-match.
    assert server["bad"] == 0 and client["bad"] == 0
    assert server["sent"] == client["received"] and client["sent"] == server["received"]
    assert server["send_sum"] == client["recv_sum"] and client["send_sum"] == server["recv_sum"]
    assert int(server["sent"]) > 0 and int(client["sent"]) > 0
    for role in ("server", "client"):
        status = json.loads((work / f"status-{role}.json").read_text())
        # Resumed in the new epoch, and posting after the restore really went through the device
        # thread (CRIU gives each restored thread its own cred; see docs/native-shim.md).
        assert status["state"] == "running" and status["epoch"] == 2, status
        assert status["delegated_writes"] > 0, status
