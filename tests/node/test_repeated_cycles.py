"""Repeated cycles: checkpoint -> restore -> checkpoint -> restore, with verbs objects made in between.

Two ranks of the all-to-all program, one per node, move to the other node (epoch 2), then create
new verbs objects in their new home (a send MR that then carries all their traffic, a CQ and a
QP), then are checkpointed again and moved back (epoch 3). The objects made after the first
restore must get virtual ids that no live object has, must survive the second cycle, and the job
must finish with exactly-once delivery in both directions.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from node.a2a_job import assert_exactly_once, assert_ok, diagnostics, prelude, ready_qpns

from testbed.coordinator import guest_envs
from testbed.guest import GuestSpec, run_pair

pytestmark = pytest.mark.twoguests

HOSTS = ["10.77.0.1", "10.77.0.2"]

SCRIPT = """
case $IBCKPT_NODE in
  # Pids far apart, so each rank's pids are free on the other node.
  1) me=0; other=1; echo 10000 > /proc/sys/kernel/ns_last_pid ;;
  2) me=1; other=0; echo 20000 > /proc/sys/kernel/ns_last_pid ;;
esac
cycle() {{  # N ckpt-session images rank-leaving restore-session epoch rank-arriving
  eval "tok_c=\\$TOKEN_C$1; tok_r=\\$TOKEN_R$1"
  IBCKPT_SESSION_TOKEN=$tok_c agent checkpoint --session $2 $(rank_args pid $4) --images $3 --mode Stop \
    > {work}/ckpt$1-node-$IBCKPT_NODE.json
  IBCKPT_SESSION_TOKEN=$tok_r agent restore --session $5 --epoch $6 $(rank_args img:$3 $7) \
    > {work}/restore$1-node-$IBCKPT_NODE.json
}}
start_rank $me
wait_for READY {work}/r$me.out 180
sleep 2
cycle 1 {c1} {work}/images1 $me {r1} 2 $other
sleep 2
touch {work}/new-objects  # both ranks, now on the other node, make new objects and use them
wait_for NEW {work}/r$other.out 120
sleep 2
cycle 2 {c2} {work}/images2 $other {r2} 3 $me
sleep 2
status_all final $me
stop_when_both_ready
wait_for DONE {work}/r$me.out 300
"""

NEW_RE = re.compile(r"NEW rank=(\d+) lkey=(\d+) old_lkeys=(\d+),(\d+) qpn=(\d+)((?: qpn\d+=\d+)+)")


def test_checkpoint_restore_twice_with_objects_created_between(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    nodes = {"node-1", "node-2"}
    ids: dict[str, str] = {}
    tokens: dict[str, dict[str, str]] = {}
    for cycle in (1, 2):
        for kind in ("c", "r"):
            ids[f"{kind}{cycle}"], tokens[f"TOKEN_{kind.upper()}{cycle}"] = coordinator.create_session(nodes)
    script = prelude(work, coordinator.port, HOSTS) + SCRIPT.format(work=work, **ids)
    env_1, env_2 = guest_envs(tokens)
    spec = GuestSpec(script, writable=[work], forward_ports=[coordinator.port], env=env_1)
    results = run_pair(spec, dataclasses.replace(spec, env=env_2), timeout=900)
    assert_ok(results, "repeated cycles", work)

    try:
        assert_exactly_once(work, len(HOSTS))
        for cycle in (1, 2):
            for node in (1, 2):
                ckpt = json.loads((work / f"ckpt{cycle}-node-{node}.json").read_text())
                assert ckpt["outcome"] == "Stopped", ckpt
                restore = json.loads((work / f"restore{cycle}-node-{node}.json").read_text())
                # Cycle 1 brings the other node's rank here; cycle 2 brings this node's own back.
                moved = 2 - node if cycle == 1 else node - 1
                assert list(restore["restored_pids"]) == [f"a2a/rank-{moved}/main/0"], restore
                assert restore["outcome"] == "Succeeded", restore
                assert all(reply["ok"] is True for reply in restore["shim"]["rebuild"].values()), restore
        for r in range(2):
            text = (work / f"r{r}.out").read_text()
            m = NEW_RE.search(text)
            assert m, f"rank {r} made no new objects:\n{text[-1500:]}"
            new_lkey, old = int(m.group(2)), {int(m.group(3)), int(m.group(4))}
            new_qpn, live_qpns = int(m.group(5)), {int(q) for q in re.findall(r"=(\d+)", m.group(6))}
            # Virtual ids are stable (the app's QPNs did not change across the move) ...
            assert set(ready_qpns(text).values()) == live_qpns
            # ... and an object made after a restore never takes a live one's id.
            assert new_lkey not in old, (r, new_lkey, old)
            assert new_qpn not in live_qpns, (r, new_qpn, live_qpns)
            status = json.loads((work / f"status-final-r{r}.json").read_text())
            assert status["state"] == "running" and status["epoch"] == 3, status
            assert status["checkpoints"] >= 2 and status["delegated_writes"] > 0, status
            by_qpn = {q["qpn"]: q for q in status["qps"]}
            assert set(by_qpn) == live_qpns | {new_qpn}, (by_qpn, new_qpn)
            # The QP made between the cycles was rebuilt by the second one too (and left in INIT).
            assert by_qpn[new_qpn]["real_qpn"] >= 0 and by_qpn[new_qpn]["state"] == 1, by_qpn[new_qpn]
    except (AssertionError, KeyError, OSError) as exc:
        raise AssertionError(f"{exc!r}{diagnostics(work, results)}") from None
