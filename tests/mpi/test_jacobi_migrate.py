"""An Open MPI job over verbs, checkpointed mid-run by the node agents and restored on the other guests.

jacobi runs on two ranks, one per guest (mpirun and rank 0 on node 1; rexec.py, the orted it
starts and rank 1 on node 2), over UCX rc_verbs under libibckpt. Mid-run each node's agent takes
a Stop checkpoint of its whole process tree (`--tree`: mpirun's on node 1, rexec's on node 2),
so the launcher, the daemon, their TCP connections (dumped with TCP repair) and the PMIx sockets
are in the images with the rank. Fresh guests boot; node 1 restores node 2's tree and node 2 node
1's, the agents' `--remap-ip` swapping the two link addresses in the images. The shim rebuilds
every QP toward the peer's new ids, and the job must finish and print exactly the RESULT line of
an uninterrupted run (computed on the host with shared memory).

Open MPI keeps files in its session directory (/tmp/ompi.*) that the processes map; CRIU
restores mappings by path, so the test carries each node's session directory to the other guest
(a pod's filesystem would travel with its checkpoint the same way).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from node.rc_pair import pinned_binaries

from testbed.guest import GUEST_HOST_ADDR, REPO, GuestResult, GuestSpec, run_pair

pytestmark = pytest.mark.twoguests

HERE = Path(__file__).resolve().parent
STEPS = 2000  # 40 s of sleeps alone: the checkpoint comes well before the end, even under load
KEYS = {1: "jacobi/rank-0/main/0", 2: "jacobi/rank-1/main/0"}
SWAP = "--remap-ip 10.77.0.1=10.77.0.2 --remap-ip 10.77.0.2=10.77.0.1"

PRELUDE = r"""
set -u
W={work}
R={repo}
printf '10.77.0.1 node-1\n10.77.0.2 node-2\n' >> /etc/hosts
mkdir -p /run/ibckpt
agent() {{
  cmd=$1; shift
  {python} -m ibckpt_node.agent_cli $cmd --coordinator {addr}:{port} --session {session} \
    --node node-$IBCKPT_NODE "$@"
}}
"""

# Each node's rank pid comes from its control socket's name (IBCKPT_CTL has %p).
PHASE1 = r"""
echo $(( IBCKPT_NODE * 10000 )) > /proc/sys/kernel/ns_last_pid  # pids free on the other guest
if [ $IBCKPT_NODE = 2 ]; then
  setsid python3 $R/tests/mpi/rexec.py serve --bind 10.77.0.2 </dev/null >$W/rexec-2.out 2>&1 &
  root=$!
else
  for i in $(seq 240); do python3 $R/tests/mpi/rexec.py 10.77.0.2 true 2>/dev/null && break; sleep 0.5; done
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  setsid sh -c 'mpirun -np 2 --host 10.77.0.1:1,10.77.0.2:1 \
      --mca plm_rsh_agent "python3 $0/tests/mpi/rexec.py" --mca oob_tcp_if_include 10.77.0.0/24 \
      --mca pml ucx --mca pml_ucx_devices any --mca osc ucx --mca btl self \
      -x UCX_NET_DEVICES=rxe0:1 -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_UD_ETH_DGID_CHECK=n \
      -x UCX_SOCKADDR_TLS_PRIORITY=tcp -x LD_PRELOAD={shim} -x IBCKPT_CTL=/run/ibckpt/ibk-%p.sock \
      -x IBCKPT_COORD=unix:/run/ibckpt/coord.sock $1/jacobi -n {steps} -s 20 > $1/job.out 2>&1
    echo $? > $1/job.rc' $R $W </dev/null >/dev/null 2>&1 &
  root=$!
fi
sock=""
for i in $(seq 600); do
  sock=$(ls /run/ibckpt/ibk-*.sock 2>/dev/null | head -1); [ -n "$sock" ] && break; sleep 0.2
done
[ -n "$sock" ] || {{ echo "no rank started on node-$IBCKPT_NODE"; exit 1; }}
pid=${{sock##*/ibk-}}; pid=${{pid%.sock}}
sleep 8  # well into the run: every QP connected, halo exchanges in flight
agent checkpoint --rank "{key}=$pid:$sock" --tree tree-$IBCKPT_NODE=$root --images $W/images --mode Stop \
  > $W/ckpt-node-$IBCKPT_NODE.json 2> $W/ckpt-node-$IBCKPT_NODE.err
echo $? > $W/ckpt-node-$IBCKPT_NODE.rc
grep -c . $W/job.out > $W/lines-at-ckpt-$IBCKPT_NODE 2>/dev/null || true
# Open MPI's session directory (files the processes map) travels with the images.
tar -C / -cf $W/session-$IBCKPT_NODE.tar $(cd / && ls -d tmp/ompi.* 2>/dev/null) dev/shm
"""

PHASE2 = r"""
from=$(( 3 - IBCKPT_NODE ))  # each node restores the other node's tree
tar -C / -xf $W/session-$from.tar
agent restore --tree $W/images/tree-$from --epoch 2 {swap} \
  > $W/restore-node-$IBCKPT_NODE.json 2> $W/restore-node-$IBCKPT_NODE.err
echo $? > $W/restore-node-$IBCKPT_NODE.rc
# mpirun (restored on node 2) writes job.rc when the job ends; both nodes wait for it.
for i in $(seq 1500); do [ -s $W/job.rc ] && break; sleep 0.2; done
if [ $IBCKPT_NODE = 1 ]; then python3 $R/tests/mpi/rexec.py --quit 10.77.0.1 || true; fi
"""


def _result(text: str) -> str:
    found = re.findall(r"^RESULT .*$", text, re.MULTILINE)
    return found[-1] if found else ""


def _diagnostics(work: Path, results: tuple[GuestResult, ...]) -> str:
    files = sorted(p for ext in ("out", "rc", "err", "json") for p in work.glob(f"*.{ext}"))
    text = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in files)
    for log in sorted(work.glob("images/*/restore.log")):
        text += f"\n--- {log}\n{log.read_text(errors='replace')[-2500:]}"
    return text + "".join(f"\n--- console node-{r.node}\n{r.output[-2500:]}" for r in results)


def test_jacobi_over_verbs_restored_on_the_other_guests(coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    mpicc = shutil.which("mpicc")
    assert mpicc, "mpicc missing: run tests/testbed/install-system.sh"
    subprocess.run([mpicc, "-O2", "-o", str(tmp_path / "jacobi"), str(HERE / "jacobi.c")], check=True)
    host = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--mca", "pml", "ob1",
         "--mca", "btl", "self,vader", str(tmp_path / "jacobi"), "-n", str(STEPS)],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    expected = _result(host)
    assert expected.startswith(f"RESULT steps={STEPS} ranks=2 ")
    shim, _ = pinned_binaries(tmp_path)

    def on_both(body: str) -> tuple[GuestResult, GuestResult]:
        session, token = coordinator.create_session({"node-1", "node-2"})
        text = (PRELUDE + body).format(
            work=tmp_path, repo=REPO, python=sys.executable,
            addr=GUEST_HOST_ADDR, port=coordinator.port, session=session, shim=shim, steps=STEPS,
            key="{key}", swap=SWAP,
        )  # fmt: skip
        specs = [
            GuestSpec(
                text.replace("{key}", KEYS[node]),
                writable=[tmp_path],
                forward_ports=[coordinator.port],
                env={"IBCKPT_SESSION_TOKEN": token},
            )
            for node in (1, 2)
        ]
        return run_pair(specs[0], specs[1], timeout=600)

    ckpt = on_both(PHASE1)
    why = _diagnostics(tmp_path, ckpt)
    for node in (1, 2):
        assert (tmp_path / f"ckpt-node-{node}.rc").read_text().strip() == "0", why
        report = json.loads((tmp_path / f"ckpt-node-{node}.json").read_text())
        assert report["outcome"] == "Stopped", report
        assert (tmp_path / "images" / f"tree-{node}" / "ibckpt-tree.json").exists(), why
    assert not (tmp_path / "job.rc").exists(), f"the job ended before the checkpoint{why}"

    restored = on_both(PHASE2)
    why = _diagnostics(tmp_path, restored)
    for node in (1, 2):
        assert (tmp_path / f"restore-node-{node}.rc").read_text().strip() == "0", why
        report = json.loads((tmp_path / f"restore-node-{node}.json").read_text())
        key = KEYS[3 - node]  # the rank that moved here
        assert report["outcome"] == "Succeeded" and report["shim"]["rebuild"][key]["ok"], report
        assert report["shim"]["resume"][key]["state"] == "running", report
    assert (tmp_path / "job.rc").read_text().strip() == "0", why
    assert _result((tmp_path / "job.out").read_text()) == expected, why
