"""A pod's checkpoint and restore through ibckpt, stage by stage, against the raw runtime: `runc checkpoint`
and `runc restore` of a container on the same node, plus an upload and a download of the same number of
bytes to the same S3 through the same path (issues 14 and 15).

Run from the repo root:  .venv/bin/python bench/pod_vs_raw.py [--raw-only BYTES]   (boots S3, the control
plane and the two Soft-RoCE nodes, installs the chart: about 20 minutes under TCG; read the ratios, not the
seconds; --raw-only measures the raw side alone, for BYTES, and prints it as JSON)

ibckpt: the two-pod ring of tests/testbed/ring.py (rc_seq under the shim, ring-0 on node-1, ring-1 on
node-2), a CheckpointJob in mode Stop, then a RestoreJob onto the swapped nodes. Each stage is the time the
job's status spent in its phase (polled every 0.5 s): admission (Pending, Admitted), cut (Quiescing,
Draining, Releasing), dump, upload, commit (Committed until Succeeded: the manifest is written at the start
of Committed, the sources are stopped after it); download, restore (the pods created, runc restore from
the staged images), rebuild, resume.

raw, on node-1 through its agent pod (privileged, hostPID; runc in the node's mount namespace as the agent
runs it): a pod of the same image and RuntimeClass without an RDMA device (a verbs process cannot be dumped
raw: CRIU refuses its device files), whose shell holds a /dev/shm file as the ring's does.
`runc checkpoint --leave-running` with the agent's flags; an upload with boto3 (the agent image's) of as
many bytes as ibckpt stored for ring-0, then their download; `runc restore --detach` of the raw images as a
second container of the same bundle, killed at once.
"""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from testbed import pods, ring
from testbed.cluster import Cluster, start_cluster
from testbed.images import APPS_IMAGE
from testbed.release import Release, install, storage_secret
from testbed.s3 import S3Server, start_s3, stop_s3

NS = "bench"
BUCKET = "bench-pod-vs-raw"
RUNC_ROOT = "/run/containerd/runc/k8s.io"
BUNDLES = "/run/containerd/io.containerd.runtime.v2.task/k8s.io"
# the raw container: a shell that holds a /dev/shm file open, as the ring's does, then sleeps
PLAIN = "echo shm-before-the-cut >/dev/shm/probe && exec 3</dev/shm/probe && exec sleep 1000000"
FLAGS = ["--tcp-established", "--file-locks", "--ext-unix-sk"]  # criu.DumpOptions' restore flags
CHECKPOINT_STAGES = {
    "admission": ("Pending", "Admitted"),
    "cut": ("Quiescing", "Draining", "Releasing"),
    "dump": ("Dumping",),
    "upload": ("Uploading",),
    "commit": ("Committed", "Stopped"),  # Stop: the manifest, then the sources end
}
RESTORE_STAGES = {
    "admission": ("Pending", "Admitted"),
    "download": ("Downloading",),
    "restore": ("Restoring",),
    "rebuild": ("Rebuilding",),
    "resume": ("Resuming",),
}

# Runs in the agent pod (its Python has boto3); reads its parameters as one JSON line on stdin, prints one
# JSON line of seconds and bytes. Nothing of the credentials is printed.
RAW = r"""
import json, os, shutil, subprocess, sys, time
import boto3
p = json.loads(sys.stdin.readline())
node = ["nsenter", "--target", "1", "--mount", "--"]
runc = node + [p["runc"], "--root", p["root"]]
work = p["work"]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work + "/img")
out = {}
t = time.monotonic()
subprocess.run(runc + ["checkpoint", "--leave-running", *p["flags"], "--image-path", work + "/img",
                       "--work-path", work + "/img", p["id"]], check=True, capture_output=True)
out["dump"] = time.monotonic() - t
out["dump_bytes"] = sum(f.stat().st_size for f in os.scandir(work + "/img") if f.is_file())
with open(work + "/payload", "wb") as f:
    f.write(os.urandom(p["bytes"]))
s3 = boto3.client("s3", endpoint_url=p["endpoint"], aws_access_key_id=p["key"],
                  aws_secret_access_key=p["secret"], region_name="us-east-1")
t = time.monotonic()
s3.upload_file(work + "/payload", p["bucket"], "raw/payload")
out["upload"] = time.monotonic() - t
t = time.monotonic()
s3.download_file(p["bucket"], "raw/payload", work + "/back")
out["download"] = time.monotonic() - t
# a second container of the same bundle: its own id and cgroup, the same root and spec
spec = json.load(open("/proc/1/root" + p["bundle"] + "/config.json"))  # the node's file
spec["root"]["path"] = p["bundle"] + "/rootfs"
spec["linux"]["cgroupsPath"] = spec["linux"].get("cgroupsPath", "") + "-raw"
os.makedirs(work + "/bundle")
json.dump(spec, open(work + "/bundle/config.json", "w"))
t = time.monotonic()
subprocess.run(runc + ["restore", "--detach", *p["flags"], "--image-path", work + "/img",
                       "--work-path", work + "/img", "--bundle", work + "/bundle", p["id"] + "-raw"],
               check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
# (no pipes: the restored process keeps its stdio open, and a pipe would never see EOF)
out["restore"] = time.monotonic() - t
subprocess.run(runc + ["delete", "--force", p["id"] + "-raw"], capture_output=True)
shutil.rmtree(work, ignore_errors=True)
print(json.dumps(out))
"""


def follow_phases(
    cluster: Cluster, kind: str, name: str, timeout: float = 1800, namespace: str = NS
) -> tuple[dict[str, float], dict[str, Any]]:
    """Seconds spent in each status phase of a job, until it ends (polled every 0.5 s)."""
    spent: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    phase, since = "Pending", time.monotonic()
    while time.monotonic() < deadline:
        obj = pods.get(cluster, namespace, kind, name)
        now = (obj.get("status") or {}).get("phase") or "Pending"
        if now != phase:
            spent[phase] = spent.get(phase, 0.0) + time.monotonic() - since
            phase, since = now, time.monotonic()
        if now in ("Succeeded", "Failed"):
            if now == "Failed":
                raise SystemExit(f"{kind} {name} failed: {json.dumps(obj['status'])[:2000]}")
            return spent, obj
        time.sleep(0.5)
    raise SystemExit(f"{kind} {name} did not finish in {timeout:g}s")


def stages(spent: dict[str, float], groups: dict[str, tuple[str, ...]]) -> dict[str, float]:
    return {stage: sum(spent.get(p, 0.0) for p in phases) for stage, phases in groups.items()}


def raw_run(
    cluster: Cluster,
    release: Release,
    s3: S3Server,
    payload: int,
    command: str = PLAIN,
    ready: Callable[[], object] | None = None,
    namespace: str = NS,
    bucket: str = BUCKET,
    timeout: float = 900,
) -> dict[str, float]:
    """The raw side on node-1: pod `plain` (the image and RuntimeClass, no device) runs `command`; once it
    runs and `ready()` returned, RAW in node-1's agent pod. Returns RAW's seconds and bytes."""
    plain = pods.rdma_pod("plain", "node-1", ["sh", "-c", command], APPS_IMAGE, host_network=False)
    plain["spec"]["runtimeClassName"] = "ibckpt"
    plain["spec"]["containers"][0].pop("resources")  # no RDMA device from the plugin
    pods.apply(cluster, namespace, plain)
    body = pods.wait_pod(cluster, namespace, "plain", {"Running"})
    if ready is not None:
        ready()
    container_id = body["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    agent = next(p for p in release.agent_pods() if p["spec"]["nodeName"] == "node-1")
    params = {
        "runc": "runc", "root": RUNC_ROOT, "id": container_id, "bundle": f"{BUNDLES}/{container_id}",
        "flags": FLAGS, "work": f"/var/lib/ibckpt/bench-raw-{secrets.token_hex(3)}", "bytes": payload,
        "endpoint": ring.storage(s3.endpoint, bucket)["spec"]["endpoint"], "bucket": bucket,
        "key": s3.access_key, "secret": s3.secret_key,
    }  # fmt: skip
    proc = cluster.kubectl(
        "exec", "-i", "-n", release.namespace, agent["metadata"]["name"], "--",
        "/opt/ibckpt/venv/bin/python", "-c", RAW, stdin=json.dumps(params) + "\n", timeout=timeout,
    )  # fmt: skip
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    cluster.kubectl("delete", "pod", "-n", namespace, "plain", "--wait=false", check=False)
    return result


def run(cluster: Cluster, s3: S3Server, raw_only: int | None = None) -> None:
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    release = install(cluster, "ibckpt", ring.PRODUCT_NS)
    release.operator_leading()  # else the first job's admission includes the operator's start
    pods.namespace(cluster, NS)
    storage_secret(cluster, NS, s3.access_key, s3.secret_key)
    pods.apply(cluster, NS, ring.storage(s3.endpoint, BUCKET))
    if raw_only is not None:  # the raw side alone, for as many bytes as an earlier run's ring-0 stored
        print(json.dumps(raw_run(cluster, release, s3, raw_only)))
        return
    ring.start(cluster, NS)

    pods.apply(cluster, NS, ring.checkpoint_job("move", "Stop"))
    spent, job = follow_phases(cluster, "checkpointjob", "move")
    checkpoint_total = ring.seconds(job)
    rows = {r["name"]: r for r in job["status"].get("pods") or ()}
    pod_bytes = int(rows["ring-0"].get("bytes") or 0)
    ckpt = stages(spent, CHECKPOINT_STAGES)
    cluster.kubectl("delete", "pod", "-n", NS, *ring.MEMBERS, "--timeout=180s", timeout=200)
    pods.apply(cluster, NS, ring.restore_job("back", job["status"]["checkpointName"]))
    spent, restored = follow_phases(cluster, "restorejob", "back")
    restore_total = ring.seconds(restored)
    rest = stages(spent, RESTORE_STAGES)
    ring.finish(cluster, NS)  # the bench measures a restore that worked: exactly once, or it stops here

    raw = raw_run(cluster, release, s3, max(pod_bytes, 1))
    raw_checkpoint = raw["dump"] + raw["upload"]
    raw_restore = raw["download"] + raw["restore"]
    print(
        f"\nring-0: {pod_bytes} bytes stored by ibckpt; the raw container's images: {raw['dump_bytes']} bytes"
    )
    print(f"{'stage':<28}{'ibckpt s':>10}{'raw s':>10}{'ratio':>8}")

    def line(name: str, ours: float, theirs: float | None) -> None:
        ratio = f"{ours / theirs:8.2f}" if theirs else f"{'-':>8}"
        print(f"{name:<28}{ours:10.2f}{(theirs if theirs is not None else float('nan')):10.2f}{ratio}")

    for stage, seconds in ckpt.items():
        line(f"checkpoint: {stage}", seconds, {"dump": raw["dump"], "upload": raw["upload"]}.get(stage))
    line("checkpoint: whole job", checkpoint_total, raw_checkpoint)
    for stage, seconds in rest.items():
        line(
            f"restore: {stage}", seconds, {"download": raw["download"], "restore": raw["restore"]}.get(stage)
        )
    line("restore: whole job", restore_total, raw_restore)
    print("(raw has no admission, cut, commit, rebuild or resume: those rows are ibckpt's own cost)")


def on_cluster(bucket: str, body: Callable[[Cluster, S3Server], None], memory_mb: int = 3072) -> None:
    """Run `body` on a fresh testbed cluster with S3 on the host (and `bucket` in it), then stop both.
    `memory_mb`: each node guest's memory (its disks are tmpfs, half of it)."""
    with tempfile.TemporaryDirectory(prefix="ibckpt-bench-") as tmp:
        work = Path(tmp)
        s3 = start_s3(work / "s3")
        try:
            s3.create_bucket(bucket)
            port = int(s3.endpoint.rsplit(":", 1)[1])
            cluster = start_cluster(work / "cluster", forward_ports=[port], memory_mb=memory_mb)
            try:
                body(cluster, s3)
            finally:
                cluster.stop()
        finally:
            stop_s3(s3)


def main() -> int:
    raw_only = int(sys.argv[sys.argv.index("--raw-only") + 1]) if "--raw-only" in sys.argv else None
    on_cluster(BUCKET, lambda cluster, s3: run(cluster, s3, raw_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
