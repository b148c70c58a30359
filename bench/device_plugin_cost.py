"""What the device plugin path and a second HCA cost a checkpoint and a restore (issue 30): the two-pod
ring of tests/testbed/ring.py moved by a Stop CheckpointJob and a RestoreJob onto the swapped nodes, on
one cluster in one run, in three shapes:
- hostPath: the lab shape the tests used before (privileged, /dev/infiniband mounted from the host), one
  HCA in use: today's path, the reference;
- plugin: unprivileged, the devices from the testbed's device plugin, one HCA in use;
- plugin+rxe1: the same, with a second HCA in use.
Beside its rank, each pod holds a second verbs process, rdma-core's `ibv_rc_pingpong` server waiting for
a client (a context, PD, MR, CQ and QP): on rxe0 in the one-HCA shapes, on rxe1 in the last, so the three
move the same processes and the last ratio is the second HCA's alone.

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

from testbed import devices, pods, ring, sibling_ids
from testbed.cluster import Cluster
from testbed.release import install, storage_secret
from testbed.s3 import S3Server

BUCKET = "bench-device-plugin"
# shape -> (how the pods get their devices, the HCA of the pingpong beside each rank)
SHAPES = {"plugin": ("plugin", "rxe0"), "hostPath": ("hostPath", "rxe0"), "plugin+rxe1": ("plugin", "rxe1")}
REFERENCE = "hostPath"


def pingpong(hca: str) -> str:
    return f"ibv_rc_pingpong -d {hca} -g 1 -p 18600 >/dev/null 2>&1"


def rails_in_use(cluster: Cluster, ns: str) -> dict[str, set[str]]:
    """Each ring pod's HCAs in use, by its processes' contexts' real GIDs (their shims' status)."""
    statuses, _ = sibling_ids.statuses(cluster, ns, ring.MEMBERS)
    used: dict[str, set[str]] = {name: set() for name in ring.MEMBERS}
    for key, status in statuses.items():
        for context in status["contexts"]:
            used[key.split("/")[0]] |= devices.rails(context["real_gids"])
    return used


def move(cluster: Cluster, ns: str, shape: str, tag: str) -> tuple[float, float]:
    """One ring in `shape`: seconds of its Stop checkpoint and of its restore, both whole jobs."""
    given, hca = SHAPES[shape]
    ring.start(cluster, ns, devices=given, beside=pingpong(hca))
    expected = {"rxe0", hca}  # the rank is on rxe0
    in_use = rails_in_use(cluster, ns)
    assert all(used == expected for used in in_use.values()), in_use
    pods.apply(cluster, ns, ring.checkpoint_job(f"move-{tag}", "Stop"))
    _, job = follow_phases(cluster, "checkpointjob", f"move-{tag}", namespace=ns)
    cluster.kubectl("delete", "pod", "-n", ns, *ring.MEMBERS, "--timeout=180s", timeout=200)
    pods.apply(cluster, ns, ring.restore_job(f"back-{tag}", job["status"]["checkpointName"]))
    _, restored = follow_phases(cluster, "restorejob", f"back-{tag}", namespace=ns)
    container = pods.get(cluster, ns, "pod", "ring-0")["spec"]["containers"][0]
    # the restored pod kept its shape (the apiserver gives a lab-shape container an empty `resources`)
    assert bool(container.get("resources", {}).get("limits")) == (given == "plugin"), container
    in_use = rails_in_use(cluster, ns)
    assert all(used == expected for used in in_use.values()), in_use
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
        for shape in list(SHAPES) if (i % 2 == 0) != flip else reversed(SHAPES):
            ns = pods.namespace(cluster, f"bench-{shape.lower().replace('+', '-')}-{i}")
            storage_secret(cluster, ns, s3.access_key, s3.secret_key)
            pods.apply(cluster, ns, ring.storage(s3.endpoint, BUCKET))
            checkpoint, restore = move(cluster, ns, shape, str(i))
            times[shape].append((checkpoint, restore))
            print(f"round {i} {shape}: checkpoint {checkpoint:.1f}s restore {restore:.1f}s", flush=True)
            pods.delete_namespace(cluster, ns)
    print(f"\nmedians of {rounds} rounds, seconds, and each shape's ratio to {REFERENCE}")
    for index, what in enumerate(("Stop checkpoint", "restore")):
        lab = statistics.median(t[index] for t in times[REFERENCE])
        cells = []
        for shape in SHAPES:
            ours = statistics.median(t[index] for t in times[shape])
            cells.append(f"{shape} {ours:.1f}s ({ours / lab:.2f}x)")
        print(f"{what:<16}" + "   ".join(cells))


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    flip = "--hostpath-first" in sys.argv  # a single round's order, the other way round
    on_cluster(BUCKET, lambda cluster, s3: run(cluster, s3, rounds, flip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
