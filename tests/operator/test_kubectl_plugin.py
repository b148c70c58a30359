"""`kubectl ibckpt`, run by kubectl as a user runs it, against the real apiserver, the operator and the real
S3 (node agents are the fakes of conftest.py): checkpoint a job's pods and follow it, list and describe the
Checkpoints, restore the latest Checkpoint of a schedule onto the swapped nodes; and the refusals a user
meets first, each in one line and with nothing created."""

from __future__ import annotations

import secrets
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ibckpt.cli.plugin import lines_between
from ibckpt.store.signing import load_keys
from testbed.cluster import kubectl_bin, kubectl_ibckpt
from testbed.kube import ControlPlane
from testbed.s3 import S3Server
from testbed.status import phase

Agents = Cluster = Any  # conftest.py's fixtures

pytestmark = [pytest.mark.kube, pytest.mark.s3, pytest.mark.usefixtures("runtime_class")]
API = "ibckpt.io/v1alpha1"


def plugin(
    kube: ControlPlane, namespace: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return kubectl_ibckpt(kube.kubeconfig, namespace, *args, timeout=timeout)


def storage_object(s3: S3Server, bucket: str, name: str = "store") -> dict[str, Any]:
    spec = {"endpoint": s3.endpoint, "region": s3.region, "bucket": bucket,
            "credentialsSecretRef": {"name": "s3-creds"}}  # fmt: skip
    return {"apiVersion": API, "kind": "CheckpointStorage", "metadata": {"name": name}, "spec": spec}


def schedule_object(name: str) -> dict[str, Any]:
    template = {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "store"}, "mode": "Stop"}
    spec = {"intervalSeconds": 3600, "suspend": True, "template": template}
    return {"apiVersion": API, "kind": "CheckpointSchedule", "metadata": {"name": name}, "spec": spec}


def test_checkpoint_list_describe_and_restore_latest_as_a_user(
    kube: ControlPlane,
    cluster_ns: Cluster,
    s3_server: S3Server,
    bucket: str,
    agents: Agents,
    operator: Any,
    store_config: Any,
    tmp_path: Path,
) -> None:
    ns = cluster_ns.namespace
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(b, "ring-1", {"app": "ring"})
    cluster_ns.s3_secret(s3_server)
    cluster_ns.create("checkpointstorages", storage_object(s3_server, bucket))
    cluster_ns.create("checkpointschedules", schedule_object("nightly"))
    # the image keys the chart mounts into the agents and the operator (one file per key id)
    keys_dir = tmp_path / "image-keys"
    keys_dir.mkdir()
    (keys_dir / "2026-11-30").write_bytes(secrets.token_bytes(32))
    a.signing = b.signing = load_keys(keys_dir)
    try:
        with operator(image_keys=str(keys_dir)):
            # A LeaveRunning checkpoint, followed phase by phase; the namespace's one storage is used.
            first = plugin(
                kube, ns, "checkpoint", "-l", "app=ring", "--name", "ring-a", "--phase-seconds", "admit=300"
            )
            assert first.returncode == 0, first.stderr
            lines = first.stdout.splitlines()
            assert lines[0] == "checkpointjob/ring-a created", first.stdout
            phases = [line.split()[0] for line in lines[1:-1]]
            for wanted in ("Quiescing", "Uploading", "Committed", "Resuming", "Succeeded"):
                assert wanted in phases, first.stdout
            assert phases[-1] == "Succeeded" and phases.index("Quiescing") < phases.index("Committed")
            job = cluster_ns.get("checkpointjobs", "ring-a")
            assert job["spec"]["storageRef"] == {"name": "store"}
            assert job["spec"]["selector"] == {"matchLabels": {"app": "ring"}}
            assert job["spec"]["timeouts"]["admitSeconds"] == 300, job["spec"]
            checkpoint_a = job["status"]["checkpointName"]
            assert lines[-1].startswith(f"checkpoint/{checkpoint_a} committed: 2 pods, "), first.stdout

            # A Stop checkpoint, as the schedule's job (its label, copied onto the Checkpoint as a schedule's
            # jobs copy it), then a newer one that is not the schedule's: --latest must take the schedule's.
            template = {
                **schedule_object("nightly")["spec"]["template"],
                "copyLabels": ["ibckpt.io/schedule"],
            }
            cluster_ns.create(
                "checkpointjobs",
                {"apiVersion": API, "kind": "CheckpointJob",
                 "metadata": {"name": "nightly-1", "labels": {"ibckpt.io/schedule": "nightly"}},
                 "spec": template},
            )  # fmt: skip
            body = cluster_ns.wait("checkpointjobs", "nightly-1", phase("Succeeded"), timeout=90)
            checkpoint_n = body["status"]["checkpointName"]
            time.sleep(1.1)  # committedTime has whole seconds
            later = plugin(kube, ns, "checkpoint", "-l", "app=ring", "--name", "ring-b", "--no-wait")
            assert later.returncode == 0 and later.stdout == "checkpointjob/ring-b created\n", later
            cluster_ns.wait("checkpointjobs", "ring-b", phase("Failed"), timeout=90)  # the pods are stopping

            listed = plugin(kube, ns, "list")
            assert listed.returncode == 0, listed.stderr
            header, *rows = listed.stdout.splitlines()
            assert header.split() == ["NAME", "JOB", "MODE", "PODS", "SIZE", "READY", "AGE"]
            by_name = {row.split()[0]: row.split() for row in rows}
            assert by_name[checkpoint_a][1:4] == ["ring-a", "LeaveRunning", "2"], listed.stdout
            assert by_name[checkpoint_n][1:4] == ["nightly-1", "Stop", "2"], listed.stdout

            described = plugin(kube, ns, "describe", checkpoint_n)
            assert described.returncode == 0, described.stderr
            text = described.stdout
            assert "CheckpointJob:" in text and "nightly-1" in text and "Mode:" in text and "Stop" in text
            pods = {line.split()[0]: line.split()[1] for line in text.split("Pods:\n")[1].splitlines()[1:3]}
            assert pods == {"ring-0": "node-a", "ring-1": "node-b"}, text
            # the timings the agents reported (Stop: the pause ends with the dump, four 0.2 s phases)
            timings = dict(line.split() for line in text.split("Timings:\n")[1].splitlines()[:7])
            assert timings["pause"] == "0.80s" and timings["dump"] == "0.20s", text
            # what a restore node must satisfy: the formats the agents wrote, as name=number
            assert "Requires:  formats (chunks=1, manifest=4, restore=1, shimProtocol=1)" in text, text
            # kubectl get: the job's size and seconds
            got = subprocess.run(
                [str(kubectl_bin()), f"--kubeconfig={kube.kubeconfig}", "get", "ckj", "ring-a", "-n", ns],
                capture_output=True, text=True, check=True,
            ).stdout.splitlines()  # fmt: skip
            assert got[0].split()[5:7] == ["SIZE", "SECONDS"], got
            seconds = got[1].split("391 KiB")[1].split()[0]  # the column after the size
            assert float(seconds) > 1.0, got

            # The Stop job deleted the sources; play their kubelets.
            for pod in ("ring-0", "ring-1"):
                cluster_ns.report_killed(pod)
                cluster_ns.core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)
            restored = plugin(
                kube, ns, "restore", "--latest", "nightly", "--avoid-source-nodes", "--name", "back"
            )
            assert restored.returncode == 0, restored.stdout + restored.stderr
            out = restored.stdout.splitlines()
            # the operator chose it (spec.latestOf), and the plugin says which
            assert out[0] == "restorejob/back created", restored.stdout
            assert [line.split()[0] for line in out[1:-2]][-1] == "Succeeded"
            assert out[-2] == f"latest checkpoint of nightly: {checkpoint_n}", restored.stdout
            assert out[-1] == f"restored from checkpoint/{checkpoint_n}: ring-0 on node-b, ring-1 on node-a"
            back = cluster_ns.get("restorejobs", "back")["spec"]
            assert back["checkpointName"] == checkpoint_n and back["latestOf"] == {"schedule": "nightly"}
            _imported_again(kube, cluster_ns, s3_server, bucket, checkpoint_a, checkpoint_n)
    finally:
        cluster_ns.delete("checkpointschedules", "nightly")


def _imported_again(
    kube: ControlPlane, cluster_ns: Cluster, s3: S3Server, bucket: str, lost: str, kept: str
) -> None:
    """`kubectl ibckpt import`: a Checkpoint object deleted with its images retained comes back from the
    bucket as it was; a manifest copied under another id (its signature covers its key) does not."""
    ns = cluster_ns.namespace
    before = cluster_ns.get("checkpoints", lost)
    cluster_ns.patch("checkpoints", lost, {"metadata": {"annotations": {"ibckpt.io/retain-images": "true"}}})
    cluster_ns.delete("checkpoints", lost)
    deadline = time.monotonic() + 60
    while cluster_ns.get("checkpoints", lost) is not None:
        assert time.monotonic() < deadline, "the Checkpoint was not deleted"
        time.sleep(0.5)
    client = s3.client()
    source = cluster_ns.get("checkpoints", kept)["spec"]["manifestKey"]
    forged = source.rsplit("/", 1)[0] + "/forged-1.json"
    client.copy_object(Bucket=bucket, Key=forged, CopySource={"Bucket": bucket, "Key": source})

    done = plugin(kube, ns, "import")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "checkpointstorage/store: import asked", done.stdout
    assert f"checkpoint/{lost} imported" in lines and lines[-1] == "1 imported, 1 skipped", done.stdout
    assert done.stderr.startswith("skipped forged-1: ") and "signature" in done.stderr, done.stderr
    again = cluster_ns.get("checkpoints", lost)
    assert again["metadata"]["labels"]["ibckpt.io/imported"] == "true"
    for field in ("pods", "jobName", "checkpointId", "manifestKey", "mode", "requires", "rankCount"):
        assert again["spec"][field] == before["spec"][field], field
    assert again["spec"]["storageRef"] == {"name": "store"}
    assert again["status"]["readyToRestore"] is True
    # asked again: nothing new (the kept one and the lost one both have their objects now)
    twice = plugin(kube, ns, "import")
    assert twice.returncode == 0 and twice.stdout.splitlines()[-1] == "0 imported, 1 skipped", twice.stdout


def test_what_a_user_gets_wrong_is_refused_in_one_line_and_creates_nothing(
    kube: ControlPlane, cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents
) -> None:
    ns = cluster_ns.namespace
    a = agents.add(cluster_ns, "node-a", 1)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})

    def refused(*args: str) -> str:
        proc = plugin(kube, ns, *args)
        assert proc.returncode == 1 and proc.stdout == "", proc
        [line] = proc.stderr.splitlines()
        assert line.startswith("error: "), line
        return line

    assert "no CheckpointStorage in namespace" in refused("checkpoint", "-l", "app=ring")
    cluster_ns.create("checkpointstorages", storage_object(s3_server, bucket, "one"))
    cluster_ns.create("checkpointstorages", storage_object(s3_server, bucket, "two"))
    assert "several CheckpointStorages (one, two): pass --storage" in refused("checkpoint", "-l", "app=ring")
    assert "CheckpointStorage nope not found" in refused("checkpoint", "-l", "app=ring", "--storage", "nope")
    assert "belongs to no workload" in refused("checkpoint", "pod/ring-0", "--storage", "one")
    assert "only key=value terms" in refused("checkpoint", "-l", "app!=ring", "--storage", "one")
    assert "Checkpoint gone not found" in refused("restore", "gone")
    assert "CheckpointSchedule none not found" in refused("restore", "--latest", "none")
    assert "give a Checkpoint's name or --latest" in refused("restore")
    bogus = refused("checkpoint", "-l", "app=ring", "--storage", "one", "--phase-seconds", "nap=3")
    assert "--phase-seconds nap=3: the phases are admit, quiesce," in bogus, bogus
    assert "whole number" in refused("restore", "gone", "--phase-seconds", "download=-1")
    assert (
        cluster_ns.custom.list_namespaced_custom_object("ibckpt.io", "v1alpha1", ns, "checkpointjobs")[
            "items"
        ]
        == []
    )
    assert plugin(kube, ns, "list").stdout == f"No Checkpoints in namespace {ns}.\n"


def test_logs_keeps_the_lines_of_the_jobs_time_and_what_follows_them() -> None:
    text = "\n".join([
        "2026-11-29 05:00:00,001 ibckpt_node.agent INFO before the job",
        "2026-11-29 05:10:00,500 ibckpt_node.driver INFO node-1: Quiesced done in 0.210s",
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "2026-11-29 05:12:04,000 ibckpt_node.agent INFO five seconds' slack after the end",
        "2026-11-29 05:30:00,000 ibckpt_node.agent INFO after the job",
    ])  # fmt: skip
    start, end = datetime(2026, 11, 29, 5, 10, tzinfo=UTC), datetime(2026, 11, 29, 5, 12, tzinfo=UTC)
    assert lines_between(text, start, end) == text.splitlines()[1:5]
