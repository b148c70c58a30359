"""perftest `ib_write_bw -D`, run for a duration between the guests, migrated mid-run, ends on time.

An unmodified third-party verbs program: the `ib_write_bw` server starts on node A (10.77.0.1)
and the client on node B (10.77.0.2), both under the shim, `-d rxe0 -x 1 -F`, for DURATION seconds,
so the client is still writing when the checkpoint starts. Each node's agent Stop-checkpoints its
rank mid-run (CRIU dumps perftest's TCP control connection with TCP repair). Fresh guests boot and
each rank is restored on the OTHER node, the agents' `--remap-ip` swapping the two addresses in the
images so the control connection follows. The client must then write until its duration ends and
print its result line, and both programs must exit 0.

perftest's duration is a chain of one-shot `alarm()`s, which CRIU before 4.1 dumps but does not
restore: the agent reads the time left from the client's core image and has its shim arm the
timer again before it resumes (ibckpt_node/itimers.py). Without that, the client writes for ever.

perftest is /usr/bin/ib_write_bw from the host's read-only root, the same file in every guest, so
only the shim needs pinning (`rc_pair.pinned_binaries`). Each rank runs under a small `sh` that
records perftest's exit status in the work dir: after the restore the ranks are nobody's children.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from node.rc_pair import KEYS, RESTORE_RANK, SWAP, SWAPPED, assert_ok, diagnostics, on_both_nodes

pytestmark = pytest.mark.twoguests

DURATION = 90  # seconds of writes; a loaded host ran out 60 before the checkpoint began
PORT = 18515  # perftest's default TCP control port
ARGS = f"-d rxe0 -x 1 -F -s 1024 -D {DURATION} -p {PORT}"

# `wait_connected`: until the shim reports every QP of this rank in RTR or RTS (perftest buffers
# its stdout, so there is no READY line to wait for; its write_bw server may stay in RTR).
HELPERS = """
wait_connected() {{
  {python} - /run/ibckpt/$role.ctl <<'EOF'
import os, sys, time
from ibckpt_native.control import ShimControl
path = sys.argv[1]
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    if os.path.exists(path):
        qps = ShimControl(path).status().get("qps", [])
        if qps and all(q["state"] in (2, 3) for q in qps):
            sys.exit(0)
    time.sleep(0.2)
sys.exit("QPs never connected")
EOF
}}
"""

PHASE1 = (
    HELPERS
    + """
case $IBCKPT_NODE in
  1) role=server; key={key0}; peer=""; echo 10000 > /proc/sys/kernel/ns_last_pid ;;
  2) role=client; key={key1}; peer=10.77.0.1; echo 20000 > /proc/sys/kernel/ns_last_pid ;;
esac
if [ $role = client ]; then
  # the server listens once its node has marked it (the work dir is shared by both guests)
  for _ in $(seq 1200); do [ -e {work}/server-listening ] && break; sleep 0.1; done
fi
rank_env="LD_PRELOAD={shim} IBCKPT_CTL=/run/ibckpt/$role.ctl IBCKPT_COORD=unix:/run/ibckpt/coord.sock"
setsid sh -c "env $rank_env /usr/bin/ib_write_bw \\"\\$@\\"; echo \\$? > {work}/$role.rc" \\
  sh {args} $peer </dev/null >{work}/$role.out 2>{work}/$role.err &
pid=$!
if [ $role = server ]; then
  # 0x{port_hex}: the control port in LISTEN (0A)
  for _ in $(seq 1200); do grep -qi ':{port_hex} 00000000:0000 0A' /proc/net/tcp && break; sleep 0.1; done
  touch {work}/server-listening
fi
wait_connected
{python} -m ibckpt_native.control /run/ibckpt/$role.ctl status > {work}/status-before-$role.json
sleep 1  # writes in flight when the checkpoint starts (100000 of them took under 4 s on a quiet host)
agent checkpoint --rank "$key=$pid:/run/ibckpt/$role.ctl" --images {work}/images --mode Stop \\
  > {work}/ckpt-node-$IBCKPT_NODE.json
echo "checkpointed $key from pid $pid"
"""
)

# each rank restored on the other node (rc_pair.SWAPPED: rank 0 to node 2, rank 1 to node 1)
PHASE2 = (
    SWAPPED
    + RESTORE_RANK
    + """for _ in $(seq 1500); do [ -e {work}/$role.rc ] && break; sleep 0.2; done
if [ ! -e {work}/$role.rc ]; then
  echo "$role has not finished 5 minutes after the restore"
  ps -eo pid,ppid,stat,wchan:32,etime,args | grep -vE 'kworker|ksoftirq|rcu_|migration|cpuhp' || true
  for p in $(pgrep -f /usr/bin/ib_write_bw); do
    grep -E 'State|SigBlk|SigPnd' /proc/$p/status; ls -l /proc/$p/fd | sed 's/.*[0-9] //'
    for t in /proc/$p/task/*; do echo "$t $(cat $t/wchan) $(cat $t/stat | cut -d' ' -f3)"; done
    cat /proc/$p/net/tcp
  done
  timeout 10 {python} -m ibckpt_native.control /run/ibckpt/$role.ctl status || true
  grep . /sys/class/infiniband/rxe0/ports/1/hw_counters/* 2>/dev/null | sed 's|.*/||' || true
  rdma res show qp -dd || true
  ip neigh; ip -s link; iptables -S || true; grep -A1 '^Udp:' /proc/net/snmp || true
  dmesg | grep -i 'watchdog' | tail -3 || true  # a stuck virtio-net TX queue on the link
  exit 1
fi
echo "$role exit status: $(cat {work}/$role.rc)"
"""
)


def _body(template: str) -> str:
    """Fill in this test's constants; `on_both_nodes` fills in the rest (work, python, shim)."""
    fixed = {
        "{key0}": KEYS[0],
        "{key1}": KEYS[1],
        "{args}": ARGS,
        "{port_hex}": f"{PORT:04X}",
        "{restore_args}": SWAP,
    }
    for name, value in fixed.items():
        template = template.replace(name, value)
    return template


def test_ib_write_bw_migrated_mid_run_ends_on_time(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path
    ckpt = on_both_nodes(coordinator, work, _body(PHASE1))
    assert_ok(ckpt, "checkpoint", work)
    # both ranks were connected and running when the checkpoint started, and still are in the images
    for role in ("server", "client"):
        status = json.loads((work / f"status-before-{role}.json").read_text())
        assert status["qps"] and all(q["state"] in (2, 3) for q in status["qps"]), status
        exited = (work / f"{role}.rc").exists()
        assert not exited, f"{role} exited before the checkpoint{diagnostics(work, ckpt)}"
    for node in (1, 2):
        report = json.loads((work / f"ckpt-node-{node}.json").read_text())
        assert report["outcome"] == "Stopped" and "Admitted" in report["phases"], report
    # the cut came mid-run: the client had posted writes on its one QP
    quiesced = json.loads((work / "ckpt-node-2.json").read_text())["shim"]["quiesce"][KEYS[1]]
    posted = [q["sends_posted"] for q in quiesced["qps"]]
    assert len(posted) == 1 and posted[0] > 0, quiesced
    for key in KEYS:
        assert (work / "images" / key.replace("/", "_") / "dump.log").exists()

    restored = on_both_nodes(coordinator, work, _body(PHASE2))
    assert_ok(restored, "restore", work)
    assert re.search(r"restored ring/rank-0/main/0 as pid \d+ on node-2", restored[1].output)
    assert re.search(r"restored ring/rank-1/main/0 as pid \d+ on node-1", restored[0].output)
    for node, key, moved in ((2, KEYS[0], "10.77.0.1 -> 10.77.0.2"), (1, KEYS[1], "10.77.0.2 -> 10.77.0.1")):
        report = json.loads((work / f"restore-node-{node}.json").read_text())
        assert report["outcome"] == "Succeeded" and report["shim"]["rebuild"][key]["ok"], report
        assert report["shim"]["resume"][key]["state"] == "running", report
        if key == KEYS[1]:  # the client's pending alarm, dropped by CRIU 3.x, armed by its shim
            armed = report["shim"]["itimer-real"][key]
            assert armed["ok"] and armed["which"] == 0 and armed["armed"] is True, report
        # perftest's control connection was in the image, and both of its addresses were rewritten
        changes = report["remapped"][key]
        assert any(f"src_addr {moved}" in c and "dst_addr" in c for c in changes), changes
        assert list((work / "images" / key.replace("/", "_")).glob("tcp-stream-*.img")), key
        local = f"10.77.0.2:{PORT} -> 10.77.0.1:" if node == 2 else "10.77.0.1:"
        assert len(report["locked"]) == 1 and report["locked"][0].startswith(local), report["locked"]

    # both perftest processes exited 0 after the move ...
    for role in ("server", "client"):
        rc = work / f"{role}.rc"
        assert rc.exists(), f"{role} never exited{diagnostics(work, restored)}"
        code = rc.read_text().strip()
        assert code == "0", f"{role} exit {code}{diagnostics(work, restored)}"
    # ... and the client's result line reports its writes: bytes, iterations, peak and average BW
    client = (work / "client.out").read_text()
    assert re.search(r"^\s*1024\s+[1-9]\d*\s+[\d.]+\s+[\d.]+", client, re.M), client
