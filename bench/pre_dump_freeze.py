"""How long a LeaveRunning checkpoint keeps a rank gated, with and without a pre-dump, in one guest.

Run from the repo root:  .venv/bin/python bench/pre_dump_freeze.py [--mib 256] [--rate 5]

One rank (native/tests/write_mem under the shim) RDMA-writes an 8 MiB region in a loop and rewrites
--rate percent of the pages of its own --mib MiB buffer each second. The node agent takes three
LeaveRunning checkpoints of it in a row: without a pre-dump, with one round of pre-dump, with rounds
as the agent runs them (predumps.PreDumpRounds), and without again (the two without bracket the
others). For each it prints the rank's gated time (from the cut's start until
it runs again: drain, release, dump, rebuild, resume; the agent's report's `gated`, which leaves out the
Resumed barrier the node meets after its ranks run, printed beside the phases' sum), CRIU's own freeze of
the dump (`frozen_time` in its stats) and the pages the dump wrote. Then the ratio the issue asks
for: the gated time with a pre-dump against CRIU's freeze of a whole dump of the same process, the
closest this testbed has to a raw `runc checkpoint --leave-running` of it (CRIU refuses the process
without ibckpt, as it holds a verbs device). The rank then checks its region (CHECK ok).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))

from ibckpt.vocabulary import GATED

KEY = "mem/rank-0/main/0"
CONTROL = "/run/ibckpt/mem.ctl"
NAMES = ("full1", "pre", "rounds", "full2")
LABELS = {
    "full1": "whole dump (before)",
    "pre": "on one pre-dump",
    "rounds": "on pre-dump rounds",
    "full2": "whole dump (after)",
}
PHASES = ("Drained", "Released", "Dumped", "Rebuilt", "Resumed")  # the fast cut: no Quiesced barrier

SCRIPT = """
set -eu
mkdir -p /run/ibckpt
LD_PRELOAD={shim} IBCKPT_CTL={control} IBCKPT_COORD=unix:/run/ibckpt/coord.sock \
  setsid {write_mem} -f {work}/check -d {mib} -r {rate} </dev/null >{work}/mem.out 2>{work}/mem.err &
echo $! > {work}/mem.pid
for _ in $(seq 3000); do grep -q READY {work}/mem.out && break; sleep 0.2; done
grep -q READY {work}/mem.out
# The images go to the guest's tmpfs, as on the cluster's nodes (agent.hostDir), not to the host's
# tree through 9p, which would time the emulated 9p link instead of CRIU. Only the stats leave.
images=/var/lib/ibckpt-bench
agent() {{
  tok=$1; session=$2; name=$3; shift 3
  IBCKPT_SESSION_TOKEN=$tok {python} -m ibckpt_node.agent_cli checkpoint --coordinator {addr}:{port} \
    --session $session \
    --ca-file {work}/coordinator-ca.crt --node node-1 --rank {key}=$(cat {work}/mem.pid):{control} \
    --mode LeaveRunning --images $images/$name "$@" > {work}/$name.json
  crit decode -i $images/$name/mem_rank-0_main_0/stats-dump > {work}/$name-stats.json
  cp $images/$name/mem_rank-0_main_0/dump.log {work}/$name-dump.log
  rounds=0; below=$images/$name/mem_rank-0_main_0
  while [ -d $below/parent ]; do rounds=$((rounds + 1)); below=$below/parent; done
  echo $rounds > {work}/$name-rounds
  rm -rf $images/$name
}}
# The guest's RAM is touched once before the first dump, which would otherwise pay qemu's first
# allocation of every page it writes (a whole dump "before" took twice the one "after" without this).
mkdir -p $images && head -c {warm_mib}M /dev/zero > $images/warm && rm $images/warm
sleep 5
agent $TOKEN_FULL1 {full1} full1
sleep 5
agent $TOKEN_PRE {pre} pre --criu-plugins {plugins} --pre-dump-settle-bytes 1000000000000
sleep 5
agent $TOKEN_ROUNDS {rounds} rounds --criu-plugins {plugins}
sleep 5
agent $TOKEN_FULL2 {full2} full2
sleep 2
touch {work}/check
for _ in $(seq 600); do grep -q CHECK {work}/mem.out && break; sleep 0.2; done
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the rank's own buffer, which its CPU dirties")
    parser.add_argument("--rate", type=float, default=5.0, help="percent of that buffer rewritten per second")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()

    from shimtest import BUILD_DIR, SHIM, TESTS_DIR
    from testbed.coordinator import ThreadedCoordinator, guest_envs
    from testbed.guest import GUEST_HOST_ADDR, GuestSpec, run
    from testbed.tlsfiles import write_test_ca

    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-predump-"))
    write_test_ca(work)
    coord = ThreadedCoordinator()
    coord.start()
    try:
        tokens: dict[str, dict[str, str]] = {}
        sessions: dict[str, str] = {}
        for name in NAMES:
            sessions[name], tokens[f"TOKEN_{name.upper()}"] = coord.create_session(
                {"node-1"}, deadline_s=1800
            )
        script = SCRIPT.format(
            **sessions,
            shim=SHIM, control=CONTROL, write_mem=TESTS_DIR / "write_mem", work=work, mib=args.mib,
            rate=args.rate, warm_mib=2 * args.mib, python=sys.executable, addr=GUEST_HOST_ADDR,
            port=coord.port, key=KEY,
            plugins=BUILD_DIR / "criu",
        )  # fmt: skip
        env, _ = guest_envs(tokens)
        memory = 1536 + 4 * args.mib  # the process, and its images (a chain of rounds) in tmpfs
        started = time.monotonic()
        result = run(
            GuestSpec(script, writable=[work], forward_ports=[coord.port], env=env, memory_mb=memory),
            timeout=3600,
        )
        guest_s = time.monotonic() - started
    finally:
        coord.stop()
    if result.returncode != 0:
        print(result.output[-4000:])
        raise SystemExit(f"the guest failed ({result.returncode}); work dir {work}")

    def load(name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((work / name).read_text())
        return data

    rows = {}
    for name in NAMES:
        report, stats = load(f"{name}.json"), load(f"{name}-stats.json")["entries"][0]["dump"]
        gated = report["phases"][GATED]
        # Released is met during the dump: its own part only
        summed = report["local"]["Released"] + sum(
            report["phases"].get(phase, 0.0) for phase in PHASES if phase != "Released"
        )
        print(f"{name}: gated {gated:.3f} s; the phases through the Resumed barrier {summed:.3f} s")
        frozen, pre = stats["frozen_time"] / 1e6, report["phases"].get("PreDumped", 0.0)
        rounds = int((work / f"{name}-rounds").read_text())
        rows[name] = (gated, frozen, stats["pages_written"], stats["pages_skipped_parent"], pre, rounds)
    check = next(line for line in (work / "mem.out").read_text().splitlines() if line.startswith("CHECK"))
    print(
        f"one rank: {args.mib} MiB its CPU rewrites at {args.rate:g}%/s, and an 8 MiB region its NIC writes"
    )
    print(f"one guest, ran {guest_s:.0f} s; after the four checkpoints the rank says: {check}\n")
    print(f"{'LeaveRunning':<22}{'gated s':>9}{'CRIU frozen s':>15}{'pages written':>15}{'from parent':>13}"
          f"{'pre-dump s':>12}{'rounds':>8}")  # fmt: skip
    for name, (gated, frozen, written, parent, pre, rounds) in rows.items():
        print(
            f"{LABELS[name]:<22}{gated:>9.2f}{frozen:>15.2f}{written:>15}{parent:>13}{pre:>12.2f}{rounds:>8}"
        )
    full_gated = (rows["full1"][0] + rows["full2"][0]) / 2
    full_frozen = (rows["full1"][1] + rows["full2"][1]) / 2
    for name in ("pre", "rounds"):
        print(f"\ngated {LABELS[name]} / gated on a whole dump:        {rows[name][0] / full_gated:.2f}")
        ratio = rows[name][0] / full_frozen
        print(f"gated {LABELS[name]} / CRIU's freeze of a whole dump: {ratio:.2f}  (goal <= 0.3)")
        print(f"CRIU's freeze {LABELS[name]} / of a whole dump:      {rows[name][1] / full_frozen:.2f}")
    if args.keep:
        print(f"\nwork dir: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if check.startswith("CHECK ok") else 1


if __name__ == "__main__":
    sys.exit(main())
