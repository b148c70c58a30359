"""What the device plugin path costs a checkpoint and a restore (issue 30): the two-pod ring of
tests/testbed/ring.py moved by a Stop CheckpointJob and a RestoreJob onto the swapped nodes, once with
unprivileged pods whose devices come from the testbed's device plugin and once in the lab shape the tests
used before (privileged, /dev/infiniband mounted from the host), on one cluster in one run.

Run from the repo root:  .venv/bin/python bench/device_plugin_cost.py [--rounds N] [--hostpath-first]
(boots S3, the control plane and the two Soft-RoCE nodes, installs the chart: about 20 minutes under TCG;
read the ratios, not the seconds). Rounds alternate the two shapes, so drift on the emulated nodes falls
on both.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pod_vs_raw import follow_phases, on_cluster  # bench/, the script's own directory

from testbed import pods, ring
from testbed.cluster import Cluster
from testbed.release import install, storage_secret
from testbed.s3 import S3Server

BUCKET = "bench-device-plugin"
SHAPES = ("plugin", "hostPath")


def move(cluster: Cluster, ns: str, devices: str, tag: str) -> tuple[float, float]:
    """One ring in `devices` shape: seconds of its Stop checkpoint and of its restore, both whole jobs."""
    ring.start(cluster, ns, devices=devices)
    pods.apply(cluster, ns, ring.checkpoint_job(f"move-{tag}", "Stop"))
    _, job = follow_phases(cluster, "checkpointjob", f"move-{tag}", namespace=ns)
    cluster.kubectl("delete", "pod", "-n", ns, *ring.MEMBERS, "--timeout=180s", timeout=200)
    pods.apply(cluster, ns, ring.restore_job(f"back-{tag}", job["status"]["checkpointName"]))
    _, restored = follow_phases(cluster, "restorejob", f"back-{tag}", namespace=ns)
    given = pods.get(cluster, ns, "pod", "ring-0")["spec"]["containers"][0]
    # the restored pod kept its shape (the apiserver gives a lab-shape container an empty `resources`)
    assert bool(given.get("resources", {}).get("limits")) == (devices == "plugin"), given
    ring.finish(cluster, ns)  # a restore that worked: exactly once, or the bench stops here
    cluster.kubectl("delete", "pod", "-n", ns, *ring.MEMBERS, "--timeout=180s", timeout=200)
    return ring.seconds(job), ring.seconds(restored)


def run(cluster: Cluster, s3: S3Server, rounds: int, flip: bool = False) -> None:
    pods.namespace(cluster, ring.PRODUCT_NS)
    storage_secret(cluster, ring.PRODUCT_NS, s3.access_key, s3.secret_key)
    release = install(cluster, "ibckpt", ring.PRODUCT_NS)
    release.operator_leading()
    times: dict[str, list[tuple[float, float]]] = {shape: [] for shape in SHAPES}
    for i in range(rounds):
        for shape in SHAPES if (i % 2 == 0) != flip else reversed(SHAPES):
            ns = pods.namespace(cluster, f"bench-{shape.lower()}-{i}")
            storage_secret(cluster, ns, s3.access_key, s3.secret_key)
            pods.apply(cluster, ns, ring.storage(s3.endpoint, BUCKET))
            checkpoint, restore = move(cluster, ns, shape, str(i))
            times[shape].append((checkpoint, restore))
            print(f"round {i} {shape}: checkpoint {checkpoint:.1f}s restore {restore:.1f}s", flush=True)
            pods.delete_namespace(cluster, ns)
    print(f"\n{'median of ' + str(rounds):<22}{'plugin s':>10}{'hostPath s':>12}{'ratio':>8}")
    for index, what in enumerate(("Stop checkpoint", "restore")):
        ours = statistics.median(t[index] for t in times["plugin"])
        lab = statistics.median(t[index] for t in times["hostPath"])
        print(f"{what:<22}{ours:10.1f}{lab:12.1f}{ours / lab:8.2f}")


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    flip = "--hostpath-first" in sys.argv  # a single round's order, the other way round
    on_cluster(BUCKET, lambda cluster, s3: run(cluster, s3, rounds, flip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
