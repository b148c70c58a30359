"""A node drain of the two-pod ring, from `kubectl drain` to the job running on the other node, split by the
migration's phases, against the sum of a CheckpointJob (Stop) and a RestoreJob of the same job (issue 17:
goal at most 1.2 times that sum).

Run from the repo root:  .venv/bin/python bench/drain_vs_jobs.py   (boots S3, the control plane and the two
Soft-RoCE nodes, installs the chart with its webhooks: about 20 minutes under TCG; read the ratio, not
the seconds)

One run, one ring (tests/testbed/ring.py: rc_seq under the shim, ring-0 on node-1, ring-1 on node-2), after a
LeaveRunning CheckpointJob that only warms the nodes (its images, caches and connections) for both sides:
1. the pair: a CheckpointJob `move` in mode Stop, the pods deleted by the user (`kubectl delete pod`,
   timed apart: the drain has to wait for the same pods to go), a RestoreJob `back` onto the swapped
   nodes; each job's time is its status' start to completion;
2. the drain of the restored ring: a CheckpointSchedule protects it, `kubectl drain node-1` (ring-1 is
   there now) until the schedule's migration is Done, both pods on node-2. The split is the time the
   schedule's `drainPhase` spent in each phase (polled every 0.5 s): hold (until the CheckpointJob admits
   the pods), checkpoint, commit (the manifest written until the sources are stopped), eviction (the PDB
   relaxed and the killed pods gone, until the RestoreJob is created: pods that keep their names are
   created again only once the old ones are gone), restore.
The ring then finishes on node-2 with every message delivered exactly once, or the bench stops there.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pod_vs_raw import follow_phases, on_cluster  # bench/, the script's own directory

from testbed import pods, ring
from testbed.cluster import WEBHOOK_NODE, Cluster, kubectl_bin
from testbed.release import install, storage_secret
from testbed.s3 import S3Server

NS = "bench"
BUCKET = "bench-drain"
SCHEDULE = "ring"
DRAIN_STAGES = {
    "hold": ("Idle", "Holding"),
    "checkpoint": ("Checkpointing",),
    "commit": ("Committed",),
    "eviction": ("Releasing",),
    "restore": ("Restoring",),
}


def follow_drain(
    cluster: Cluster, timeout: float = 1800
) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    """Seconds the schedule's migration spent in each drainPhase until Done (polled every 0.5 s), and the
    wall-clock time each phase was entered."""
    spent: dict[str, float] = {}
    entered: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    phase, since = "Idle", time.monotonic()
    while time.monotonic() < deadline:
        obj = pods.get(cluster, NS, "checkpointschedule", SCHEDULE)
        now = (obj.get("status") or {}).get("drainPhase") or "Idle"
        if now != phase:
            spent[phase] = spent.get(phase, 0.0) + time.monotonic() - since
            phase, since = now, time.monotonic()
            entered.setdefault(now, time.time())
        if now in ("Done", "Failed", "Held", "Lost"):
            if now != "Done":
                raise SystemExit(f"the migration ended {now}: {obj['status'].get('drainMessage')}")
            return spent, entered, obj
        time.sleep(0.5)
    raise SystemExit(f"the migration did not finish in {timeout:g}s")


def run(cluster: Cluster, s3: S3Server) -> None:
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    release = install(cluster, "ibckpt", ring.PRODUCT_NS, operator_node=WEBHOOK_NODE)
    release.operator_leading()
    pods.namespace(cluster, NS)
    storage_secret(cluster, NS, s3.access_key, s3.secret_key)
    pods.apply(cluster, NS, ring.storage(s3.endpoint, BUCKET))
    ring.start(cluster, NS)
    pods.apply(cluster, NS, ring.checkpoint_job("warm", "LeaveRunning"))
    follow_phases(cluster, "checkpointjob", "warm")

    pods.apply(cluster, NS, ring.checkpoint_job("move", "Stop"))
    _, job = follow_phases(cluster, "checkpointjob", "move")
    began = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", NS, *ring.MEMBERS, "--timeout=180s", timeout=200)
    deleted = time.monotonic() - began
    pods.apply(cluster, NS, ring.restore_job("back", job["status"]["checkpointName"]))
    _, restored = follow_phases(cluster, "restorejob", "back")
    pair = ring.seconds(job) + ring.seconds(restored)
    assert ring.placement(cluster, NS) == {"ring-0": "node-2", "ring-1": "node-1"}

    ring.protect(cluster, NS, ring.job_template(), {"deadlineSeconds": 1500}, name=SCHEDULE)
    began = time.monotonic()
    drain = subprocess.Popen(
        [str(kubectl_bin()), f"--kubeconfig={cluster.kubeconfig}", "drain", "node-1", "--ignore-daemonsets",
         "--delete-emptydir-data", "--force", "--timeout=1500s"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        spent, entered, done = follow_drain(cluster)
        total = time.monotonic() - began
        drained = drain.wait(timeout=600)
    finally:
        drain.kill()
        cluster.kubectl("uncordon", "node-1", check=False)
    assert drained == 0, "kubectl drain failed"
    assert ring.placement(cluster, NS) == {"ring-0": "node-2", "ring-1": "node-2"}
    ring.finish(cluster, NS)  # exactly once, or the bench stops here

    migration = done["status"]["migration"]
    migrated_job = pods.get(cluster, NS, "checkpointjob", migration["checkpointJob"])
    migrated_restore = pods.get(cluster, NS, "restorejob", migration["restoreJob"])
    created = datetime.fromisoformat(migrated_restore["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    waited = max(0.0, created.timestamp() - entered.get("Restoring", created.timestamp()))  # 1 s resolution
    split = {stage: sum(spent.get(p, 0.0) for p in phases) for stage, phases in DRAIN_STAGES.items()}
    split["eviction"] += waited
    split["restore"] -= waited
    print(f"\n{'drain stage':<34}{'seconds':>10}")
    for stage, seconds in split.items():
        print(f"{stage:<34}{seconds:10.2f}")
    print(f"{'drain to running':<34}{total:10.2f}")
    print(
        f"(inside the drain: its CheckpointJob {ring.seconds(migrated_job):.2f}s, "
        f"its RestoreJob {ring.seconds(migrated_restore):.2f}s)"
    )
    print(
        f"pair: CheckpointJob {ring.seconds(job):.2f}s + RestoreJob {ring.seconds(restored):.2f}s "
        f"= {pair:.2f}s; the user's kubectl delete between them {deleted:.2f}s"
    )
    print(f"drain / pair = {total / pair:.2f} (goal <= 1.2)")
    print(f"drain / (pair + the user's delete) = {total / (pair + deleted):.2f}")


def main() -> int:
    on_cluster(BUCKET, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
