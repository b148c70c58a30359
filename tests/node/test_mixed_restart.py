"""Mixed restart: four all-to-all ranks on two nodes; node B's ranks move to node A, node A's stay.

Ranks 0 and 1 run on node A, ranks 2 and 3 on node B, each with one RC QP to every other rank,
exchanging sequence-numbered, checksummed messages. Mid-traffic one checkpoint session runs on
both nodes: node B checkpoints with mode Stop (its ranks are dumped and gone), node A with mode
Hold (dumped too, then left alive and released). A restore session on node A then CRIU-restores
ranks 2 and 3 from their images and, in the same epoch, rebuilds the held ranks 0 and 1 toward
the moved peers' new GID and QPNs. Node B powers off; all four ranks finish on node A and every
ordered pair must show exactly-once delivery with matching checksums.

Both nodes pre-dump their ranks before the cut, with the traffic on, and dump after the release only
what changed since (issue 31). The receive buffers are written by the device, which no page table sees:
had the shim not marked them at release (native/src/redirty.c), node B's ranks would come back with
the pre-dump's stale buffers, and the checksums of the messages they had received but not yet read
would not match.

The moved ranks are siblings (issue 29): they share node B's GID as their virtual one. Node B's QP
numbers were made to run ahead of node A's (QPs made and dropped before its ranks start), so the QPs
the moved ranks make on node A after the restore get real numbers from the very range their virtual
ones hold. The agent reserved each one's QPNs in the other (runtime-hook/ibckpt_node/qpn_reserve.py),
so the shim takes other numbers (native/src/reserve.c): no virtual QPN is both ranks', and the new
QPs keep their real QPNs as virtual ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from node.a2a_job import assert_exactly_once, assert_ok, diagnostics, prelude, ready_qpns
from node.criu_stats import dump_stats

from shimtest import BUILD_DIR, TESTS_DIR
from testbed.coordinator import guest_envs
from testbed.guest import GuestSpec, run_pair

pytestmark = pytest.mark.twoguests

HOSTS = ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
NEW_QPS = 6  # each moved rank makes, after the restore
CHURN = 24  # QPs node B makes and drops first: node A hands out its ranks' numbers only later
CRIU_PLUGINS = BUILD_DIR / "criu"  # ibckpt_uverbs.so alone

SCRIPT = """
case $IBCKPT_NODE in
  1) mine="0 1"; mode=Hold ;;
  # Node B's ranks take pids far above anything node A will use, so they are free there. They make
  # new objects when new-objects-b appears (the later -m wins).
  2) mine="2 3"; mode=Stop; echo 20000 > /proc/sys/kernel/ns_last_pid
     A2A_EXTRA="-Q {new_qps} -m {work}/new-objects-b"
     {many} -n {churn} -f {work}/churned > {work}/churn.out 2>&1 &
     wait_for READY {work}/churn.out 120; touch {work}/churned; wait ;;
esac
for r in $mine; do start_rank $r; done
for r in $mine; do wait_for READY {work}/r$r.out 180; done
sleep 3  # traffic in flight on every QP when the checkpoint starts
IBCKPT_SESSION_TOKEN=$TOKEN_CKPT agent checkpoint --session {ckpt} $(rank_args pid $mine) \
  --images {work}/images --mode $mode --criu-plugins {plugins} > {work}/ckpt-node-$IBCKPT_NODE.json
[ $IBCKPT_NODE = 2 ] && exit 0  # its ranks now live only in the images
for r in 0 1; do grep -q DONE {work}/r$r.out && {{ echo "rank $r ended before the restore"; exit 1; }}; done
IBCKPT_SESSION_TOKEN=$TOKEN_RESTORE agent restore --session {restore} --epoch 2 \
  $(rank_args img:{work}/images 2 3) $(rank_args rejoin 0 1) > {work}/restore.json
sleep 3  # traffic after the move, all four ranks on node A
touch {work}/new-objects-b
for r in 2 3; do wait_for NEW {work}/r$r.out 120; done
status_all after 0 1 2 3
touch {work}/stop
for r in 0 1 2 3; do wait_for DONE {work}/r$r.out 300; done
"""


def test_one_nodes_ranks_move_while_the_others_stay(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    ckpt, tokens_ckpt = coordinator.create_session({"node-1", "node-2"})
    restore, tokens_restore = coordinator.create_session({"node-1"})
    names = {"many": TESTS_DIR / "many_qps", "churn": CHURN, "new_qps": NEW_QPS, "plugins": CRIU_PLUGINS}
    script = prelude(work, coordinator.port, HOSTS) + SCRIPT.format(
        work=work, ckpt=ckpt, restore=restore, **names
    )
    env_1, env_2 = guest_envs({"TOKEN_CKPT": tokens_ckpt, "TOKEN_RESTORE": tokens_restore})
    spec = GuestSpec(script, writable=[work], forward_ports=[coordinator.port], env=env_1)
    results = run_pair(spec, dataclasses.replace(spec, env=env_2), timeout=900)
    assert_ok(results, "mixed restart", work)

    try:
        assert_exactly_once(work, len(HOSTS))
        ckpt_a = json.loads((work / "ckpt-node-1.json").read_text())
        ckpt_b = json.loads((work / "ckpt-node-2.json").read_text())
        assert ckpt_a["outcome"] == "Held" and ckpt_b["outcome"] == "Stopped"
        # A real checkpoint of all four ranks: every rank has an image.
        for r in range(4):
            assert (work / "images" / f"a2a_rank-{r}_main_0" / "dump.log").exists()
        assert_dumped_on_pre_dumps(work, ckpt_a, ckpt_b)
        restored = json.loads((work / "restore.json").read_text())
        assert set(restored["restored_pids"]) == {"a2a/rank-2/main/0", "a2a/rank-3/main/0"}
        assert set(restored["shim"]["rebuild"]) == {f"a2a/rank-{r}/main/0" for r in range(4)}
        pids = {r: int((work / f"r{r}.pid").read_text()) for r in range(4)}
        for r in range(4):
            status = json.loads((work / f"status-after-r{r}.json").read_text())
            assert status["state"] == "running" and status["epoch"] == 2, (r, status)
            if r < 2:
                # Stayed: the same process, rebuilt in place, never CRIU-restored.
                assert status["pid"] == pids[r], (r, status)
                assert status["delegated_writes"] == 0, (r, status)
            else:
                # Moved: restored from its image on node A (CRIU gave each thread its own cred).
                assert status["delegated_writes"] > 0, (r, status)
        assert_siblings_apart(work)
    except (AssertionError, KeyError, OSError) as exc:
        raise AssertionError(f"{exc!r}{diagnostics(work, results)}") from None


def assert_dumped_on_pre_dumps(work: Path, *reports: dict[str, Any]) -> None:
    """Each node pre-dumped, each rank's release marked its MR pages, and each rank's dump holds its
    pre-dump as `parent` and took pages from it (CRIU's own account, tests/node/test_pre_dump_guest.py)."""
    for report in reports:
        assert "PreDumped" in report["phases"], report["phases"]
        for key, reply in report["shim"]["release"].items():
            assert reply["redirtied_pages"] > 0 and reply["redirty_missed_bytes"] == 0, (key, reply)
    for r in range(4):
        images = work / "images" / f"a2a_rank-{r}_main_0"
        parent = images / "parent"
        assert parent.is_dir() and not parent.is_symlink(), sorted(p.name for p in images.iterdir())
        assert (parent / "pre-dump.log").exists()  # moved in: nothing is left where it was made
        assert not (work / "images" / ".pre-dumps" / images.name).exists()
        stats = dump_stats(images)
        assert stats["pages_skipped_parent"] > 0, (r, stats)


NEW_RE = re.compile(r"NEW rank=\d+ lkey=\d+ old_lkeys=\d+,\d+ qpn=(\d+)((?: more=\d+)*)")
TAKEN = "was taken (a live virtual QPN here or a sibling's)"


def assert_siblings_apart(work: Path) -> None:
    """Ranks 2 and 3 (node B's GID) made QPs on node A after the restore: none took a live virtual QPN
    of either, each kept its real QPN, and they did meet taken numbers. Ranks 0 and 1 made none."""
    statuses = {r: json.loads((work / f"status-after-r{r}.json").read_text()) for r in (2, 3)}
    held = {r: {q["qpn"] for q in s["qps"]} for r, s in statuses.items()}
    assert not held[2] & held[3], sorted(held[2] & held[3])
    for r in (2, 3):
        text = (work / f"r{r}.out").read_text()
        m = NEW_RE.search(text)
        assert m, f"rank {r} made no new objects:\n{text[-1500:]}"
        made = [int(m.group(1)), *(int(q) for q in re.findall(r"more=(\d+)", m.group(2)))]
        assert len(made) == NEW_QPS and set(made) <= held[r], (r, made)
        assert not set(made) & set(ready_qpns(text).values()), (r, made)
        real = {q["qpn"]: q["real_qpn"] for q in statuses[r]["qps"]}
        assert all(real[q] == q for q in made), (r, made, real)  # peers reach them as they are
    assert any(TAKEN in (work / f"r{r}.err").read_text() for r in (2, 3)), "no QPN was taken"
    assert not any("NEW" in (work / f"r{r}.out").read_text() for r in (0, 1))
