"""An MPI job in pods, on the real cluster with the chart installed: Open MPI over UCX on two HCAs per node
(multi-rail: rxe0 and rxe1, each on a link of its own), a launcher pod
(mpirun and rank 0) on node-1 and a worker pod (the exec server mpirun starts orted with, and rank 1) on
node-2, both owned by an MPIJob as the MPI Operator creates them (tests/testbed/mpijob.py). A run of
jacobi is moved, and must still print exactly the RESULT of an uninterrupted run of the same binary: a
CheckpointJob names the MPIJob (workloadRef) and stops it mid-run; once the pods are deleted, a RestoreJob
brings both back on the other nodes (the launcher on node-2, the worker on node-1): the processes
restored through the runtime, node addresses mapped in their TCP connections (mpirun to orted, the exec
server's), queue pairs rebuilt through the operator's coordinator. The team's storage encrypts
client-side: every chunk in the bucket is sealed, and the restore reads them with the team's key.

The test drives it as a user does: `kubectl ibckpt checkpoint mpijob/...`, `list`, `describe`, `logs`
(the real agents' lines) and `restore`, besides kubectl. (The reference run goes beside the job, to keep
the suite's time. A second move by `kubectl drain node-1` under a CheckpointSchedule was dropped on
2026-11-29 for the same reason: drains of pods owned by a controller are tests/helm/test_drain_job.py
and test_drain_statefulset.py.)
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator

import pytest
from helm.conftest import NAMESPACE, Release

from ibckpt.store import codec
from testbed import devices, mpijob, pods, ring, sibling_ids
from testbed.cluster import Cluster, kubectl_ibckpt, node_ip
from testbed.s3 import S3Server

# budget: at most what it took on the slowest machine seen (tests/testbed/budget.py)
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3000), pytest.mark.budget(minutes=10)]


def _the_plugin_shows(cluster: Cluster, job_ns: str, checkpoint: str) -> None:
    """`list`, `describe` and `logs` of the plugin, against the real agents that took the checkpoint."""
    listed = kubectl_ibckpt(cluster.kubeconfig, job_ns, "list")
    assert listed.returncode == 0 and checkpoint in listed.stdout, listed
    described = kubectl_ibckpt(cluster.kubeconfig, job_ns, "describe", checkpoint)
    assert described.returncode == 0, described
    for pod, node in ((mpijob.LAUNCHER, "node-1"), (mpijob.WORKER, "node-2")):
        assert any(pod in line and node in line for line in described.stdout.splitlines()), described.stdout
    logs = kubectl_ibckpt(cluster.kubeconfig, job_ns, "logs", "jacobi-stop", "--agent-namespace", NAMESPACE)
    assert logs.returncode == 0, logs
    by_node = {line.split(" | ", 1)[0] for line in logs.stdout.splitlines()}
    assert by_node == {"node-1", "node-2"}, logs.stdout[-3000:]


@pytest.fixture
def mpi_crd(installed: Release) -> Iterator[None]:
    mpijob.install_crd(installed.cluster)
    try:
        yield
    finally:
        installed.cluster.kubectl("delete", "crd", f"mpijobs.{mpijob.GROUP}", "--wait=false", check=False)


def _seal_the_storage(cluster: Cluster, job_ns: str) -> str:
    """The team's storage encrypts client-side (AES-256-GCM in the agents, the key in the team's
    Secret, which only the agents read, by name). Its bucket's name."""
    key = base64.b64encode(os.urandom(32)).decode()
    cluster.kubectl("create", "secret", "generic", "sealing", "-n", job_ns,
                    f"--from-literal=IBCKPT_ENCRYPTION_KEY={key}")  # fmt: skip
    sealed = {"spec": {"encryption": {"mode": "client", "keySecretRef": {"name": "sealing"}}}}
    cluster.kubectl(
        "patch", "checkpointstorage", "store", "-n", job_ns, "--type=merge", "-p", json.dumps(sealed)
    )
    return str(pods.get(cluster, job_ns, "checkpointstorage", "store")["spec"]["bucket"])


def _sealed_in_the_bucket(s3: S3Server, bucket: str) -> None:
    """Every chunk in S3 is stored sealed (codec.py's header: cipher AES-256-GCM), none in the clear."""
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    chunks = [k for k in keys if "/chunks/" in k]
    assert chunks, keys
    for k in chunks:
        head = client.get_object(Bucket=bucket, Key=k, Range="bytes=0-15")["Body"].read()
        assert head[:4] == codec.MAGIC and head[6] == codec.Cipher.AES_256_GCM, (k, head)


def _both_rails_recorded(s3: S3Server, bucket: str) -> None:
    """The checkpoint's manifest (signed, not sealed) records that each rank's UCX held verbs contexts on
    both HCAs of its node, and the order its pod was given them: node-2's plugin gives them last first
    (devices.REVERSED_ON), so each pod is restored on a node that lists its HCAs the other way round."""
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    manifests = [k for k in keys if "/manifests/" in f"/{k}" and k.endswith(".json")]
    assert len(manifests) == 1, keys
    manifest = json.loads(client.get_object(Bucket=bucket, Key=manifests[0])["Body"].read())
    used = {
        key: sorted(names) for rank in manifest["ranks"] for key, names in rank["devices"]["used"].items()
    }
    assert len(used) == 2 and all(names == sorted(mpijob.RAILS) for names in used.values()), used
    for rank in manifest["ranks"]:
        given = [d for d in rank["devices"]["allocated"] if d in mpijob.RAILS]
        expected = list(mpijob.RAILS)[:: -1 if rank["node"] in devices.REVERSED_ON else 1]
        assert given == expected, rank


def _rails_kept_by_name(cluster: Cluster, job_ns: str) -> None:
    """Each restored rank's verbs contexts, read from its shim's `status` in its pod: each is on the HCA
    of the name it was opened with (its real GIDs on the link its virtual ones are on), though the
    new node gave the pod its HCAs in the other order (ibckpt/devicemap.py: the same name first)."""
    statuses, _ = sibling_ids.statuses(cluster, job_ns, list(mpijob.MEMBERS))
    ranks = [s for s in statuses.values() if s["contexts"]]
    assert len(ranks) == 2, statuses
    for status in ranks:
        opened = [devices.rails(c["gids"]) for c in status["contexts"]]
        now = [devices.rails(c["real_gids"]) for c in status["contexts"]]
        assert opened == now and sorted(d for o in opened for d in o) == sorted(mpijob.RAILS), status


def test_an_mpijob_moved_by_a_restorejob_prints_the_uninterrupted_result(
    installed: Release, job_ns: str, mpi_crd: None, s3_server: S3Server
) -> None:
    cluster = installed.cluster
    bucket = _seal_the_storage(cluster, job_ns)
    mpijob.start_uninterrupted(cluster, job_ns)
    mpijob.start(cluster, job_ns)

    # The user's tool: `kubectl ibckpt` names the MPIJob and follows the CheckpointJob it creates.
    taken = kubectl_ibckpt(
        cluster.kubeconfig, job_ns, "checkpoint", f"mpijob/{mpijob.NAME}", "--mode", "Stop",
        "--name", "jacobi-stop", "--phase-seconds", "admit=300", timeout=960,
    )  # fmt: skip
    assert taken.returncode == 0, f"{taken.stdout}\n{taken.stderr}"
    printed = taken.stdout.splitlines()
    assert printed[0] == "checkpointjob/jacobi-stop created", taken.stdout
    assert "Stopped" in [line.split()[0] for line in printed[1:-1]], taken.stdout
    done = ring.wait_phase(cluster, job_ns, "checkpointjob", "jacobi-stop", "Succeeded", 60)
    committed = f"checkpoint/{done['status']['checkpointName']} committed: 2 pods, "
    assert printed[-1].startswith(committed), printed
    before = mpijob.log(cluster, job_ns)
    cut_at = max(mpijob.steps(before))
    assert mpijob.result(before) is None and cut_at < mpijob.STEPS - 50, before[-2000:]  # stopped mid-run
    assert {p["name"] for p in done["status"]["pods"]} == set(mpijob.MEMBERS), done["status"]
    checkpoint = pods.get(cluster, job_ns, "checkpoint", done["status"]["checkpointName"])
    spec = checkpoint["spec"]
    assert {p["name"]: p["node"] for p in spec["pods"]} == {
        mpijob.LAUNCHER: "node-1",
        mpijob.WORKER: "node-2",
    }
    assert spec["source"]["kind"] == "MPIJob" and spec["source"]["name"] == mpijob.NAME, spec["source"]
    # rank 0 in the launcher, rank 1 under the worker's orted; mpirun, orted and the exec server are no ranks
    ranks = {p["name"]: len(p.get("ranks") or ()) for p in spec["pods"]}
    assert ranks == {mpijob.LAUNCHER: 1, mpijob.WORKER: 1} and spec["rankCount"] == 2, spec["pods"]
    _the_plugin_shows(cluster, job_ns, checkpoint["metadata"]["name"])
    _sealed_in_the_bucket(s3_server, bucket)
    _both_rails_recorded(s3_server, bucket)

    cluster.kubectl("delete", "pod", "-n", job_ns, *mpijob.MEMBERS, "--timeout=120s", timeout=150)
    back = kubectl_ibckpt(
        cluster.kubeconfig, job_ns, "restore", checkpoint["metadata"]["name"], "--avoid-source-nodes",
        "--name", "jacobi-back", "--phase-seconds", "admit=300", timeout=960,
    )  # fmt: skip
    assert back.returncode == 0, f"{back.stdout}\n{back.stderr}"
    name = checkpoint["metadata"]["name"]
    assert back.stdout.splitlines()[-1].startswith(f"restored from checkpoint/{name}:"), back.stdout
    restored = ring.wait_phase(cluster, job_ns, "restorejob", "jacobi-back", "Succeeded", 60)
    placed = {p["metadata"]["name"]: p for p in pods.get(cluster, job_ns, "pods")["items"]}
    assert placed[mpijob.LAUNCHER]["spec"]["nodeName"] == "node-2", restored["status"]
    assert placed[mpijob.WORKER]["spec"]["nodeName"] == "node-1", restored["status"]
    assert placed[mpijob.WORKER]["status"]["podIP"] == node_ip(1)
    moved = mpijob.progress(cluster, job_ns, cut_at)
    _rails_kept_by_name(cluster, job_ns)
    expected = mpijob.uninterrupted(cluster, job_ns)  # done long ago

    after = mpijob.finish(cluster, job_ns)
    resumed = mpijob.steps(after)
    assert resumed and min(resumed) > cut_at, f"cut at {cut_at}:\n{after[-3000:]}"
    assert "mpirun-exit=0" in after, after[-3000:]
    assert mpijob.result(after) == expected, f"{after[-3000:]}\nexpected {expected}"
    print(
        f"jacobi: cut at step {cut_at}, ran to {moved} on the swapped nodes, of {mpijob.STEPS}; "
        f"CheckpointJob {ring.seconds(done):.1f}s, RestoreJob {ring.seconds(restored):.1f}s; {expected}"
    )
