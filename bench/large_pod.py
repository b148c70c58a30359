"""A pod that holds real-sized memory, checkpointed and restored through ibckpt, against the raw tools on the
same node in the same run (issue 31): the freeze, the Stop checkpoint and the restore, at each size given.

Run from the repo root:  .venv/bin/python bench/large_pod.py [--mib 64 512] [--rate 5] [--agent-memory 2Gi]
                             [--guest-memory-mib 6144] [--disk-window-mib 16]
(boots S3, the control plane and the two Soft-RoCE nodes and installs the chart, about 15 minutes under TCG,
then about 10 minutes per 256 MiB; read the ratios, not the seconds)

ibckpt: pod `big` on node-1, unprivileged, its device from the plugin, runs native/tests/write_mem under the
shim: RDMA WRITEs into an 8 MiB region in a loop, beside a buffer of MIB MiB of random bytes of which it
rewrites RATE percent of the pages every second. Per size:
  1. a LeaveRunning CheckpointJob with `preDump`: the pod's frozenSeconds from the job's status (the cut's
     start until its rank ran again: drain, release, the final dump, rebuild, resume);
  2. a Stop CheckpointJob: apply to Succeeded (committed, the source stopped), and what node-1's disk
     window did (the testbed release's 16 MiB unless --disk-window-mib says otherwise; 0: off);
  3. a RestoreJob onto node-2: apply to Succeeded (running again); then the rank stops and checks that its
     region holds every write it completed (CHECK ok), so the numbers are those of a restore that worked.
raw, on node-1 through its agent pod (hostPID; the node's runc and root, as the agent runs them): a pod of
the same image and RuntimeClass without a device runs `write_mem -n` (the same buffer, the same rate, no
verbs, so CRIU dumps it without ibckpt):
  freeze   `runc checkpoint --leave-running`, whole (with no pre-dump CRIU keeps the process frozen until
           its pages are written; the runc and CRIU start are counted too, in ibckpt's favour);
  stop     that dump + a boto3 upload (multipart, the client's defaults) of as many random bytes as
           ibckpt stored for the pod (bench/pod_vs_raw.py's raw side; a dump that kills the container
           costs the same, and would leave no rootfs for the restore);
  restore  their boto3 download + `runc restore --detach` as a second container of the same bundle.
Goals (issue 31): freeze <= 0.3x at 5%/s, stop <= 1.0x, restore <= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pod_vs_raw import (  # bench/, the script's own directory
    CHECKPOINT_STAGES,
    RESTORE_STAGES,
    follow_phases,
    on_cluster,
    raw_run,
    stages,
)

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE
from testbed.release import Release, install, storage_secret
from testbed.s3 import S3Server

NS = "bench"
BUCKET = "bench-large-pod"
LABELS = {"app": "big"}


def write_mem(mib: int, rate: float, *, device: bool) -> list[str]:
    args = f"-f /tmp/stop -d {mib} -r {rate:g}" + ("" if device else " -n")
    return ["sh", "-c", f"write_mem {args}; echo big-done $?; exec sleep 1000000"]


def big_pod(mib: int, rate: float) -> dict[str, Any]:
    pod = pods.rdma_pod("big", "node-1", write_mem(mib, rate, device=True), APPS_IMAGE, labels=LABELS)
    pod["spec"]["hostNetwork"] = False
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


def wait_log(cluster: Cluster, pod: str, word: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.kubectl("logs", "-n", NS, pod, check=False).stdout
        if word in out:
            return out
        time.sleep(2)
    raise SystemExit(f"{pod} did not print {word} in {timeout:g}s: {cluster.diagnose()[-3000:]}")


def job(name: str, mode: str, pre_dump: bool = False) -> dict[str, Any]:
    body = ring.checkpoint_job(name, mode)
    body["spec"]["selector"] = {"matchLabels": LABELS}
    body["spec"]["timeouts"].update({"dumpSeconds": 1800, "uploadSeconds": 3600})
    if pre_dump:
        body["spec"]["preDump"] = True
    return body


def events(cluster: Cluster, name: str, job: dict[str, Any]) -> list[str]:
    """The job's Events, each as `+SECONDS reason: message` from its start (CreatingPods says the pods
    were created while the last bytes downloaded; WaitingForAgent, that an agent was busy)."""
    found = json.loads(cluster.kubectl("get", "events", "-n", NS, "-o", "json",
                                       "--field-selector", f"involvedObject.name={name}").stdout)  # fmt: skip
    start = datetime.fromisoformat(job["status"]["startTime"].replace("Z", "+00:00"))
    lines = []
    for event in found["items"]:
        at = event.get("eventTime") or event.get("lastTimestamp") or event.get("firstTimestamp")
        when = (
            (datetime.fromisoformat(at.replace("Z", "+00:00")) - start).total_seconds()
            if at
            else float("nan")
        )
        lines.append((when, f"+{when:.0f}s {event['reason']}: {event['message'][:160]}"))
    return [line for _, line in sorted(lines)]


# node-1's agent after a Stop's dump (runtime-hook/ibckpt_node/agent/preupload.py)
WINDOW_LINE = re.compile(
    r"(\d+) bytes left the disk as they were uploaded; the images held at most (\d+) bytes "
    r"\(window (\d+); CRIU paused (\d+) times, ([\d.]+)s\)"
)


def window_seen(release: Release) -> str:
    said = list(WINDOW_LINE.finditer(release.logs("agent")))
    if not said:
        return "no disk window (or nothing it could release)"
    released, held, window, pauses, paused = said[-1].groups()
    return (
        f"{int(released) / 1e6:.0f} MB left the disk during the dump, at most {int(held) / 1e6:.0f} MB held "
        f"(window {int(window) / 1e6:.0f} MB), CRIU paused {pauses} times for {float(paused):.1f} s"
    )


def ibckpt_side(cluster: Cluster, release: Release, mib: int, rate: float) -> dict[str, Any]:
    pods.apply(cluster, NS, big_pod(mib, rate))
    pods.wait_pod(cluster, NS, "big", {"Running"})
    wait_log(cluster, "big", "READY")
    out: dict[str, Any] = {}

    pods.apply(cluster, NS, job(f"lr-{mib}", "LeaveRunning", pre_dump=True))
    spent, done = follow_phases(cluster, "checkpointjob", f"lr-{mib}", timeout=3600, namespace=NS)
    row = next(r for r in done["status"]["pods"] if r["name"] == "big")
    out["freeze"] = float(row["frozenSeconds"])
    timings = done["status"].get("timings") or {}
    out["pre_dump"] = float(timings.get("preDumpSeconds") or 0.0)
    out["lr_total"] = ring.seconds(done)

    pods.apply(cluster, NS, job(f"stop-{mib}", "Stop"))
    spent, done = follow_phases(cluster, "checkpointjob", f"stop-{mib}", timeout=3600, namespace=NS)
    out["stop"] = ring.seconds(done)
    out["stop_stages"] = stages(spent, CHECKPOINT_STAGES)
    row = next(r for r in done["status"]["pods"] if r["name"] == "big")
    out["bytes"] = int(row.get("bytes") or 0)
    out["window"] = window_seen(release)
    checkpoint = done["status"]["checkpointName"]

    cluster.kubectl("delete", "pod", "-n", NS, "big", "--timeout=180s", timeout=200)
    pods.apply(cluster, NS, ring.restore_job(f"back-{mib}", checkpoint))
    spent, done = follow_phases(cluster, "restorejob", f"back-{mib}", timeout=3600, namespace=NS)
    out["restore"] = ring.seconds(done)
    out["restore_stages"] = stages(spent, RESTORE_STAGES)
    out["restore_events"] = events(cluster, f"back-{mib}", done)
    node = pods.get(cluster, NS, "pod", "big")["spec"]["nodeName"]
    cluster.kubectl("exec", "-n", NS, "big", "--", "touch", "/tmp/stop")
    log = wait_log(cluster, "big", "big-done")
    if "CHECK ok" not in log:
        raise SystemExit(f"the restored rank's region is wrong:\n{log[-2000:]}")
    print(f"{mib} MiB: restored on {node}; {log.strip().splitlines()[-2]}")
    # gone before the next size applies its own `big` (an apply to a pod still terminating is an update)
    cluster.kubectl("delete", "pod", "-n", NS, "big", "--timeout=300s", check=False, timeout=320)
    return out


def raw_side(cluster: Cluster, release: Release, s3: S3Server, mib: int, rate: float, payload: int) -> Any:
    """pod_vs_raw's raw side on `write_mem -n`: its leave-running dump, `payload` bytes to S3 and back, and
    its restore as a second container."""
    cluster.kubectl("delete", "pod", "-n", NS, "plain", "--timeout=120s", check=False, timeout=150)
    command = " ".join(shlex.quote(a) for a in write_mem(mib, rate, device=False))

    def ready() -> None:
        wait_log(cluster, "plain", "READY")
        time.sleep(5)  # its buffer dirtied for a while, as the ibckpt side's was before its cut

    result = raw_run(cluster, release, s3, payload, command, ready, NS, BUCKET, timeout=3600)
    return {**result, "freeze": result["dump"]}  # --leave-running: frozen until its pages are written


def report(mib: int, rate: float, ours: dict[str, Any], raw: dict[str, Any]) -> None:
    def line(name: str, a: float, b: float | None) -> None:
        ratio = f"{a / b:8.2f}x" if b else f"{'-':>9}"
        print(f"  {name:<34}{a:10.1f}{(b if b is not None else float('nan')):10.1f}{ratio}")

    mb = ours["bytes"] / 1e6
    print(
        f"\n{mib} MiB at {rate:g}%/s: ibckpt stored {mb:.0f} MB for the pod; "
        f"raw images {raw['dump_bytes'] / 1e6:.0f} MB"
    )
    print(f"  {'':<34}{'ibckpt s':>10}{'raw s':>10}{'ratio':>9}")
    line("freeze (LeaveRunning, pre-dumped)", ours["freeze"], raw["freeze"])
    line("  its pre-dump, while running", ours["pre_dump"], None)
    line("  the whole LeaveRunning job", ours["lr_total"], None)
    line("stop: apply to committed", ours["stop"], raw["dump"] + raw["upload"])
    print(f"    its disk window: {ours['window']}")
    for stage, seconds in ours["stop_stages"].items():
        line(f"  {stage}", seconds, {"dump": raw["dump"], "upload": raw["upload"]}.get(stage))
    line("restore: apply to running", ours["restore"], raw["download"] + raw["restore"])
    for stage, seconds in ours["restore_stages"].items():
        line(f"  {stage}", seconds, {"download": raw["download"], "restore": raw["restore"]}.get(stage))
    up = ours["stop_stages"].get("upload") or 0.0
    if up:
        print(
            f"  upload rate: ibckpt {mb / up:.1f} MB/s, "
            f"raw boto3 {mb / raw['upload']:.1f} MB/s (the same bytes)"
        )
    print("  the RestoreJob's Events (from its start):")
    for event in ours.get("restore_events", []):
        print(f"    {event}")


def run(
    cluster: Cluster, s3: S3Server, sizes: list[int], rate: float, agent_memory: str, window_mib: int | None
) -> None:
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    values = [f"agent.resources.limits.memory={agent_memory}"] if agent_memory else []
    if window_mib is not None:
        values.append(f"agent.diskWindowBytes={window_mib << 20}")
    release = install(cluster, "ibckpt", ring.PRODUCT_NS, values=values)
    release.operator_leading()
    pods.namespace(cluster, NS)
    storage_secret(cluster, NS, s3.access_key, s3.secret_key)
    pods.apply(cluster, NS, ring.storage(s3.endpoint, BUCKET))
    for mib in sizes:
        ours = ibckpt_side(cluster, release, mib, rate)
        print(json.dumps({"mib": mib, "rate": rate, "ibckpt": ours}), flush=True)
        raw = raw_side(cluster, release, s3, mib, rate, max(ours["bytes"], 1))
        print(json.dumps({"mib": mib, "rate": rate, "raw": raw}), flush=True)
        report(mib, rate, ours, raw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument(
        "--rate", type=float, default=5.0, help="percent of the buffer's pages rewritten per second"
    )
    parser.add_argument(
        "--agent-memory",
        default="",
        help="the agents' memory limit (the chart's default unless given): the testbed's disks are tmpfs, "
        "so the image files CRIU writes count in the agent's memory (docs/node-agent.md)",
    )
    parser.add_argument(
        "--guest-memory-mib",
        type=int,
        default=3072,
        help="each node guest's memory; its tmpfs disks get half: a pre-dumped pod's images are on it "
        "twice, beside the pod's own memory (6144 for 512 MiB)",
    )
    parser.add_argument(
        "--disk-window-mib",
        type=int,
        default=None,
        help="the agents' disk window (docs/node-agent.md); the testbed release's 16 MiB unless given, "
        "0 turns it off",
    )
    args = parser.parse_args()
    on_cluster(
        BUCKET,
        lambda cluster, s3: run(cluster, s3, args.mib, args.rate, args.agent_memory, args.disk_window_mib),
        memory_mb=args.guest_memory_mib,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
