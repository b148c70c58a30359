"""From a dead rank to the job running again, by itself, against a person's RestoreJob (issue 27).

The two-pod ring of tests/testbed/ring.py under a CheckpointSchedule with `recovery`; once a checkpoint has
committed, ring-1's processes are killed from its node (exit 137). The automatic recovery is timed from the
kill, on the host's clock, in three parts seen by polling the schedule's status: detection (until the
recovery starts), fencing (until its RestoreJob exists) and restore (until Recovered). Then the same
checkpoint is restored the way a person would at the moment of a failure: delete the job's pods, apply a
RestoreJob naming the checkpoint, wait for it. Both in one run, on one cluster.

Goal (issue 27): detection + fencing within the bound plus 10 s (a pod failure has no bound: 0), and the
whole recovery within 1.2x the person's restore plus the bound.

Run from the repo root:  .venv/bin/python bench/recovery_time.py [--rounds N]
(boots S3, the control plane and the two Soft-RoCE nodes, installs the chart: about 20 minutes under TCG;
read the ratios, not the seconds).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pod_vs_raw import on_cluster  # bench/, the script's own directory

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.release import Release, install, storage_secret
from testbed.s3 import S3Server

BUCKET = "bench-recovery"
SCHEDULE = "ring"
POLL_S = 0.5


def _status(cluster: Cluster, ns: str) -> dict[str, object]:
    found: dict[str, object] = pods.get(cluster, ns, "checkpointschedule", SCHEDULE).get("status") or {}
    return found


def _protect_and_checkpoint(release: Release, ns: str) -> str:
    """The ring under a schedule with recovery; returns its first committed Checkpoint, once suspended."""
    cluster = release.cluster
    ring.start(cluster, ns)
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": SCHEDULE},
        "spec": {
            "intervalSeconds": 60,  # the first fires after one interval; suspended once it committed
            "template": ring.job_template(),
            "recovery": {"podFailure": True, "deadlineSeconds": 900},
        },
    }
    pods.apply(cluster, ns, schedule)
    deadline = time.monotonic() + 900
    while True:
        found = pods.get(cluster, ns, "checkpoints", **{"ibckpt.io/schedule": SCHEDULE})["items"]
        if found:
            return str(found[0]["metadata"]["name"])
        if time.monotonic() > deadline:
            raise SystemExit(f"no checkpoint in 900 s:\n{ring.diagnose(cluster, ns)}")
        time.sleep(2)


def automatic(release: Release, ns: str, seq: int) -> dict[str, float]:
    """Kill ring-1's rank; seconds from the kill to each part's end, seen on the host."""
    cluster = release.cluster
    node = ring.placement(cluster, ns)["ring-1"]
    killed_at = time.monotonic()
    killed = ring.kill_rank(release, node)  # a restore by hand may have swapped the nodes
    if "killed" not in killed.stdout:
        raise SystemExit(f"the rank killer found nothing: {killed.stdout}{killed.stderr}")
    marks: dict[str, float] = {}
    deadline = killed_at + 1200
    while time.monotonic() < deadline:
        status = _status(cluster, ns)
        recovery = status.get("recovery") or {}
        assert isinstance(recovery, dict)
        now = time.monotonic() - killed_at
        if recovery.get("seq") == seq:
            marks.setdefault("detected", now)
            if recovery.get("restoreJob"):
                marks.setdefault("fenced", now)
            phase = status.get("recoveryPhase")
            if phase == "Recovered":
                marks["recovered"] = now
                return {
                    "detection": marks["detected"],
                    "fencing": marks["fenced"] - marks["detected"],
                    "restore": marks["recovered"] - marks["fenced"],
                    "total": marks["recovered"],
                }
            if phase in ("Failed", "WaitingForPerson"):
                raise SystemExit(f"recovery {phase}: {json.dumps(status)[:2000]}")
        time.sleep(POLL_S)
    raise SystemExit(f"no recovery in 1200 s:\n{ring.diagnose(cluster, ns)}")


def by_hand(cluster: Cluster, ns: str, checkpoint: str, name: str) -> float:
    """What a person does at the failure: delete the job's pods, apply a RestoreJob; seconds to Succeeded."""
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", ns, *ring.MEMBERS, "--timeout=180s", timeout=200)
    pods.apply(cluster, ns, ring.restore_job(name, checkpoint))
    ring.wait_phase(cluster, ns, "restorejob", name, "Succeeded", 1200)
    return time.monotonic() - started


def run(cluster: Cluster, s3: S3Server, rounds: int) -> None:
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    release = install(cluster, "ibckpt", ring.PRODUCT_NS, operator_node="node-2")
    release.operator_leading()
    ns = pods.namespace(cluster, "bench-recovery")
    storage_secret(cluster, ns, s3.access_key, s3.secret_key)
    pods.apply(cluster, ns, ring.storage(s3.endpoint, BUCKET))
    checkpoint = _protect_and_checkpoint(release, ns)
    cluster.kubectl("patch", "checkpointschedule", SCHEDULE, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"suspend": True}}))  # fmt: skip
    time.sleep(5)
    for job in pods.get(cluster, ns, "checkpointjobs")["items"]:  # none may run while measured
        ring.wait_phase(cluster, ns, "checkpointjob", job["metadata"]["name"], "Succeeded", 600)
    autos: list[dict[str, float]] = []
    hands: list[float] = []
    for i in range(rounds):
        time.sleep(10)  # the (restored) ring exchanges messages before it is hit again
        autos.append(automatic(release, ns, i + 1))
        time.sleep(10)
        hands.append(by_hand(cluster, ns, checkpoint, f"by-hand-{i}"))
        print(f"round {i}: automatic {autos[-1]}  by hand {hands[-1]:.1f}s", flush=True)
    ring.finish(cluster, ns)  # every restore above worked: exactly once, or the bench stops here
    auto = {part: statistics.median(a[part] for a in autos) for part in autos[0]}
    hand = statistics.median(hands)
    print(f"\nmedian of {rounds}, seconds from the kill (a pod failure: bound 0)")
    for part in ("detection", "fencing", "restore", "total"):
        print(f"  {part:<12}{auto[part]:8.1f}")
    print(f"  {'by hand':<12}{hand:8.1f}")
    print(f"detection + fencing = {auto['detection'] + auto['fencing']:.1f}s (goal: <= 10 s)")
    print(f"automatic / by hand = {auto['total'] / hand:.2f} (goal: <= 1.2)")


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    on_cluster(BUCKET, lambda cluster, s3: run(cluster, s3, rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
