"""Measure what each real part of the testbed costs in time and memory.

Run from the repo root:  .venv/bin/python bench/testbed_costs.py
Prints one table: start-up time and peak RSS for SeaweedFS, the kube control plane,
one Soft-RoCE guest (boot + trivial command), two linked guests, and the two-node cluster
(start to both nodes Ready, a pod's create to Running, each node guest's memory).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import json

from testbed import pods
from testbed.cluster import start_cluster
from testbed.guest import GuestSpec, run, run_pair
from testbed.images import APPS_IMAGE
from testbed.kube import start_control_plane
from testbed.s3 import start_s3, stop_s3


def rss_mb(pid: int) -> float:
    """Resident set size of a process and all its descendants, in MiB."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pids += [int(c) for c in children]
    return total / 1024


class PeakRss:
    """Samples the summed RSS of all qemu processes while a guest runs."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0.0
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        if Path(f"/proc/{entry}/comm").read_text().strip() == "qemu-system-x86":
                            total += rss_mb(int(entry))
                    except OSError:
                        pass
            self.peak = max(self.peak, total)
            time.sleep(0.2)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    rows: list[tuple[str, float, float]] = []

    t0 = time.monotonic()
    s3 = start_s3()
    started = time.monotonic() - t0
    s3.client().create_bucket(Bucket="bench-costs")
    s3.client().put_object(Bucket="bench-costs", Key="k", Body=b"x" * (8 << 20))
    rows.append(("SeaweedFS weed mini (ready; RSS after an 8 MiB PUT)", started, rss_mb(s3.pid)))
    stop_s3(s3)

    t0 = time.monotonic()
    plane = start_control_plane(controller_manager=False)
    started = time.monotonic() - t0
    etcd, apiserver = plane.pids[0], plane.pids[1]
    rows.append(("etcd + kube-apiserver (to /readyz)", started, rss_mb(etcd) + rss_mb(apiserver)))
    plane.stop()

    with PeakRss() as peak:
        t0 = time.monotonic()
        result = run(GuestSpec("true"), timeout=300)
        assert result.returncode == 0, result.output
        rows.append(("one guest: boot + `true` + power off", time.monotonic() - t0, peak.peak))

    with PeakRss() as peak:
        t0 = time.monotonic()
        a, b = run_pair(GuestSpec("true"), GuestSpec("true"), timeout=300)
        assert a.returncode == 0 and b.returncode == 0, a.output + b.output
        rows.append(("two linked guests: boot + `true` (both qemu)", time.monotonic() - t0, peak.peak))

    with PeakRss() as peak:
        t0 = time.monotonic()
        cluster = start_cluster()
        rows.append(("cluster: start to both nodes Ready (peak, both)", time.monotonic() - t0, peak.peak))
        try:
            pod = pods.image_pod("bench", "node-1", APPS_IMAGE, ["sleep", "99"])
            t0 = time.monotonic()
            cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
            cluster.kubectl("wait", "--for=condition=Ready", "pod/bench", "--timeout=300s", timeout=320)
            rows.append(("cluster: pod create to Running (node-1)", time.monotonic() - t0, 0.0))
            for g in cluster.guests.guests:
                name = f"cluster: node-{g.spec.node} guest with a pod (qemu RSS)"
                rows.append((name, 0.0, rss_mb(g.proc.pid)))
        finally:
            cluster.stop()

    print(f"{'part':<55} {'seconds':>8} {'RSS MiB':>8}")
    for name, seconds, mem in rows:
        print(f"{name:<55} {seconds:8.1f} {mem:8.0f}")


if __name__ == "__main__":
    main()
