"""`make demo`: the product on a local cluster. A two-pod RDMA job is checkpointed by a CheckpointJob and
brought back by a RestoreJob on the other nodes, and finishes with every message delivered exactly once.

1. SeaweedFS S3 and a control plane (etcd, kube-apiserver, scheduler, controller-manager) on 127.0.0.1;
   two qemu guests with Soft-RoCE join it as node-1 and node-2 (kubelet, containerd, runc).
2. `helm install` of the chart from this repository: the operator, an agent on each node, the RuntimeClass
   `ibckpt` whose runtime wrapper preloads the shim into RDMA containers.
3. An unmodified `rc_seq` pair in two pods (ring-0 on node-1, ring-1 on node-2) exchanges checked RC traffic.
4. `kubectl apply` a CheckpointJob (mode Stop): quiesce, drain, release, dump through runc, upload to S3,
   commit; the pods end only after the commit.
5. `kubectl apply` a RestoreJob with avoidSourceNodes: new pods of the same names, each on the other
   node, restored from S3, their queue pairs rebuilt through the operator's coordinator, resumed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from testbed import pods, ring
from testbed.cluster import Cluster, start_cluster
from testbed.release import Release, install, storage_secret
from testbed.s3 import S3Server, start_s3, stop_s3

BUCKET = "ibckpt-demo"
JOB_NS = "demo"
FINISHED = ("Succeeded", "Failed")


def follow(console: Console, cluster: Cluster, kind: str, name: str, timeout: float = 1200) -> dict[str, Any]:
    """Print the job's phase and its pods' rows whenever they change, until it ends."""
    deadline, shown, started = time.monotonic() + timeout, "", time.monotonic()
    obj: dict[str, Any] = {}
    while time.monotonic() < deadline:
        obj = pods.get(cluster, JOB_NS, kind, name)
        status = obj.get("status") or {}
        rows = ", ".join(f"{p['name']}@{p.get('node')}: {p.get('phase')}" for p in status.get("pods") or ())
        now = f"{status.get('phase', 'Pending')}  {rows}"
        if now != shown:
            console.print(f"  [{time.monotonic() - started:6.1f}s] {kind} {name}: {now}")
            shown = now
        if status.get("phase") in FINISHED:
            return obj
        time.sleep(2)
    raise TimeoutError(f"{kind} {name} did not finish in {timeout:g}s: {json.dumps(obj.get('status'))}")


def run(console: Console, work: Path) -> bool:
    s3 = start_s3(work / "s3")
    try:
        console.print(f"S3 (SeaweedFS, SigV4): {s3.endpoint}")
        console.rule("the cluster: control plane on 127.0.0.1, node-1 and node-2 in Soft-RoCE guests")
        cluster = start_cluster(work / "cluster", forward_ports=[int(s3.endpoint.rsplit(":", 1)[1])])
        try:
            for what, seconds in cluster.timings.items():
                console.print(f"  {what}: {seconds:.1f}s")
            console.print(f"  export KUBECONFIG={cluster.kubeconfig}   (while the demo runs)")
            release = install_product(console, cluster, s3)
            return move_job(console, cluster, s3, release)
        finally:
            cluster.stop()
    finally:
        stop_s3(s3)


def install_product(console: Console, cluster: Cluster, s3: S3Server) -> Release:
    """Step 2: the chart, with the S3 keys the agents stage images with."""
    console.rule("helm install ibckpt")
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    release = install(cluster, "ibckpt", ring.PRODUCT_NS)
    # a job applied before the operator leads would sit Pending until it does (minutes on these nodes)
    waited = time.monotonic()
    leader = release.operator_leading()
    console.print(f"  {leader} leads (waited {time.monotonic() - waited:.1f}s)")
    for pod in pods.get(cluster, ring.PRODUCT_NS, "pods")["items"]:
        meta, where = pod["metadata"], pod["spec"].get("nodeName")
        console.print(f"  {meta['name']} on {where}: {pod['status']['phase']}")
    return release


def move_job(console: Console, cluster: Cluster, s3: S3Server, release: Release) -> bool:
    """Steps 3-5 on a cluster where the chart is installed: the job, its CheckpointJob, its RestoreJob."""
    s3.create_bucket(BUCKET)
    pods.namespace(cluster, JOB_NS)
    storage_secret(cluster, JOB_NS, s3.access_key, s3.secret_key)
    pods.apply(cluster, JOB_NS, ring.storage(s3.endpoint, BUCKET))

    console.rule("the job: rc_seq in ring-0 (node-1) and ring-1 (node-2), RuntimeClass ibckpt")
    ring.start(cluster, JOB_NS)
    console.print("  connected, traffic flowing: " + str(ring.placement(cluster, JOB_NS)))

    console.rule("kubectl apply: CheckpointJob move (mode Stop)")
    pods.apply(cluster, JOB_NS, ring.checkpoint_job("move", "Stop"))
    job = follow(console, cluster, "checkpointjob", "move")
    if job["status"]["phase"] != "Succeeded":
        message = job["status"].get("message")
        console.print(f"[red]checkpoint failed: {message}\n{ring.diagnose(cluster, JOB_NS)}")
        return False
    checkpoint = pods.get(cluster, JOB_NS, "checkpoint", job["status"]["checkpointName"])
    spec = checkpoint["spec"]
    console.print(
        f"committed in S3: {len(spec['pods'])} pods, {spec['size']['bytes']} bytes, "
        f"s3://{BUCKET}/{spec.get('manifestKey', '')}"
    )

    console.rule("kubectl apply: RestoreJob back (avoidSourceNodes)")
    cluster.kubectl("delete", "pod", "-n", JOB_NS, *ring.MEMBERS, "--timeout=120s", timeout=150)
    restore = ring.restore_job("back", checkpoint["metadata"]["name"])
    pods.apply(cluster, JOB_NS, restore)
    restored = follow(console, cluster, "restorejob", "back")
    if restored["status"]["phase"] != "Succeeded":
        message = restored["status"].get("message")
        console.print(f"[red]restore failed: {message}\n{ring.diagnose(cluster, JOB_NS)}")
        return False
    console.print("  restored: " + str(ring.placement(cluster, JOB_NS)))
    return report(console, cluster, job, restored, release.name)


def report(
    console: Console, cluster: Cluster, job: dict[str, Any], restored: dict[str, Any], release: str
) -> bool:
    try:
        found = ring.finish(cluster, JOB_NS)
    except AssertionError as error:
        console.print(f"[red]exactly-once check FAILED: {error}")
        return False
    table = Table(title="the job after its move")
    for column in ("pod", "sent", "received", "bad", "send checksum", "receive checksum"):
        table.add_column(column)
    for name, r in zip(ring.MEMBERS, found, strict=True):
        table.add_row(name, r["sent"], r["received"], r["bad"], r["send_sum"], r["recv_sum"])
    console.print(table)
    console.print(
        f"CheckpointJob {ring.seconds(job):.1f}s, RestoreJob {ring.seconds(restored):.1f}s "
        f"(emulated nodes: ~20x slower than real ones); chart release {release}"
    )
    console.print("[green]every message delivered exactly once, checksums match on both sides")
    return True


def main() -> int:
    console = Console()
    console.rule("[bold]ibckpt demo: checkpoint a two-pod RDMA job to S3 and restore it on the other nodes")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ibckpt-demo-") as tmp:
        ok = run(console, Path(tmp))
    console.print(f"Total {time.monotonic() - started:.1f} s. " + ("[green]OK" if ok else "[red]FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
