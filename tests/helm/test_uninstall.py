"""The session's release at its end: a `helm upgrade` to a release with another shim file, which rolls
the agents and the operator while a checkpoint runs (and gives the agents a disk reserve no node can
honour: the next checkpoint is refused; a checkpoint from before it, its object deleted and imported
again from the bucket, restores with the shim build its processes mapped),
an upgrade that leaves a node without a prerequisite, then `helm uninstall`, after which the nodes are as
they were before the install and the agents' storage grants are gone.

Runs last among the cluster's tests (files sort after every other cluster test): it ends the release
the others share. The nodes started with containerd's stock configuration (node-init.sh keeps a copy on
the host); the agents added the ibckpt handler and labelled the nodes (test_chart.py checks that).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from helm.conftest import NAMESPACE, RELEASE, Release

from testbed import pods, ring
from testbed.cluster import NODE_NAMES, Cluster, kubectl_ibckpt
from testbed.images import APPS_IMAGE, NEXT_IMAGE
from testbed.release import CHART, helm

# budget (tests/testbed/budget.py): 9.4 min (10.3 with its teardown) in CI's run of 2026-12-04; 14 on
# the slowest machine seen. 10: at CI's usual pace this last story starts.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400), pytest.mark.budget(minutes=10)]

READY_LABEL = "ibckpt.io/runtime-ready"
HOST_LIB = "/host/usr/local/lib/ibckpt"  # the node's, in the agent
IN_SHIM = "/run/ibckpt/lib/libibckpt.so"  # the shim where a container sees it (hook/oci.py)
REASON_MISSING = "NodePrerequisiteMissing"
NS = "bystanders"
NODE_FILES = (
    "/usr/local/bin/ibckpt-runc",
    "/usr/local/bin/ibckpt-hook",
    "/usr/local/lib/ibckpt/builds",  # every shim build kept
    "/usr/local/lib/ibckpt/criu",  # CRIU's plugin for pre-dumps
    "/usr/local/lib/ibckpt/launch",  # Python's launchers, behind the compiled front
    "/usr/local/lib/ibckpt/runc",  # the front's link to runc
    "/etc/ibckpt/node.json",
)


def _events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    found = cluster.kubectl("get", "events", "-A", "--field-selector", f"reason={reason}", "-o", "json")
    items: list[dict[str, Any]] = json.loads(found.stdout)["items"]
    return items


def _wait(what: str, check: Any, timeout: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(3)
    raise AssertionError(f"{what}: not within {timeout:g}s")


def _node_view(cluster: Cluster, node: str) -> str:
    """What a pod with no privilege sees of the node's containerd config and ibckpt's files (hostPath)."""
    name = f"look-{node}"
    script = "cat /node/etc/containerd/config.toml; echo '=== files'; " + "; ".join(
        f"{{ test -e /node{path} || test -L /node{path}; }} && echo present {path}" for path in NODE_FILES
    )
    pod = pods.image_pod(name, node, APPS_IMAGE, [])
    pod["spec"]["containers"][0]["command"] = ["sh", "-c", script + "; true"]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "root", "mountPath": "/node", "readOnly": True}]
    pod["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
    pods.apply(cluster, NS, pod)
    pods.wait_pod(cluster, NS, name, {"Succeeded"}, timeout=300)
    return cluster.kubectl("logs", "-n", NS, name).stdout


# Before these the job has not reached the nodes; from Quiescing on, an upgrade meets it there.
NOT_YET = {None, "Pending", "Admitted"}
ENDED = {"Succeeded", "Failed"}
STORAGES = "checkpointstorages.ibckpt.io"
TIB = 1 << 40


def _grants(cluster: Cluster, namespace: str) -> list[str]:
    """Which of the agents' storage Role and RoleBinding a team's namespace holds."""
    kinds = ("role", "rolebinding")
    name = f"{RELEASE}-agent-storage"
    return [k for k in kinds if cluster.kubectl("get", k, name, "-n", namespace, check=False).returncode == 0]


def _upgrade_during_a_checkpoint(installed: Release, job_ns: str) -> None:
    """`helm upgrade` rolls every agent and the operator while a LeaveRunning checkpoint is on the nodes:
    the job succeeds or aborts, the ranks keep running and deliver every message once, and a checkpoint
    taken before the upgrade restores after it."""
    cluster = installed.cluster
    ring.start(cluster, job_ns)
    pods.apply(cluster, job_ns, ring.checkpoint_job("before", "LeaveRunning"))
    before = ring.wait_phase(cluster, job_ns, "checkpointjob", "before", "Succeeded", 900)
    checkpoint = before["status"]["checkpointName"]
    # the shim build the ranks' processes map, which a restore after the upgrade must mount again
    old_shim = pods.get(cluster, job_ns, "checkpoints.ibckpt.io", checkpoint)["spec"]["requires"]["shim"]
    assert old_shim, "the checkpoint records no shim build"

    pods.apply(cluster, job_ns, ring.checkpoint_job("during", "LeaveRunning"))

    def on_the_nodes() -> str | None:
        phase = (pods.get(cluster, job_ns, "checkpointjob", "during").get("status") or {}).get("phase")
        assert phase not in ENDED, f"the job ended ({phase}) before the upgrade could meet it"
        return None if phase in NOT_YET else phase

    met = _wait("the job on the nodes", on_the_nodes, timeout=600)
    # a new release (its image ships another shim file): every pod of the chart rolls; and the agents
    # now leave more of their disk to the node than the node has
    helm(
        cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
        "--set", f"image.tag={NEXT_IMAGE.rsplit(':', 1)[1]}",
        "--set", f"agent.diskReserveBytes={TIB}",
    )  # fmt: skip

    def ended() -> dict[str, Any] | None:
        job: dict[str, Any] = pods.get(cluster, job_ns, "checkpointjob", "during")
        return job if (job.get("status") or {}).get("phase") in ENDED else None

    status = _wait("the job met by the upgrade ends", ended, timeout=900)["status"]
    installed.rollout(f"daemonset/{RELEASE}-agent")
    installed.operator_leading()
    outcome = f"{status['phase']} ({status.get('reason')}: {status.get('message')})"
    print(f"upgrade met the job in {met}: it ended {outcome}")
    if status["phase"] == "Failed":  # aborted: every rank was resumed, the partial checkpoint not listed
        message = status.get("message") or ""
        assert "resume failed" not in message and "not confirmed" not in message, status
        listed = pods.get(cluster, job_ns, "checkpoints.ibckpt.io")["items"]
        assert [c["metadata"]["name"] for c in listed] == [checkpoint], listed
    ring.running(cluster, job_ns)  # no rank died or was restarted

    # a checkpoint the nodes' disks cannot hold (with the reserve) is refused before any rank is touched
    pods.apply(cluster, job_ns, ring.checkpoint_job("no-room", "LeaveRunning"))
    refused = ring.wait_phase(cluster, job_ns, "checkpointjob", "no-room", "Failed", 600)["status"]
    assert refused["reason"] == "PreflightRefused", refused
    assert "refusing to checkpoint on this node: its images would need about" in refused["message"], refused
    assert f"of which the agent leaves 1024.0 GiB ({TIB} bytes)" in refused["message"], refused
    assert "resume failed" not in refused["message"], refused  # the ranks never stopped
    ring.running(cluster, job_ns)
    ring.finish(cluster, job_ns)  # the ranks still deliver every message exactly once

    # the checkpoint from before the upgrade, its object lost (images kept) and imported from the bucket
    # by the upgraded release, restores
    ckpt = ("checkpoint.ibckpt.io", checkpoint, "-n", job_ns)
    cluster.kubectl("annotate", *ckpt, "ibckpt.io/retain-images=true")
    cluster.kubectl("delete", *ckpt, "--timeout=120s", timeout=150)
    imported = kubectl_ibckpt(cluster.kubeconfig, job_ns, "import", timeout=360)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert f"checkpoint/{checkpoint} imported" in imported.stdout.splitlines(), imported.stdout
    cluster.kubectl("delete", "pod", "-n", job_ns, *ring.MEMBERS, "--timeout=120s", timeout=150)
    pods.apply(cluster, job_ns, ring.restore_job("after", checkpoint))
    ring.wait_phase(cluster, job_ns, "restorejob", "after", "Succeeded", 900)
    _restored_with_their_own_shim(installed, job_ns, old_shim)
    ring.finish(cluster, job_ns)
    # the team's objects go while the operator runs (their finalizers are its); the namespace stays,
    # with the agents' storage grant the operator made there, for helm uninstall to take away
    for kinds in ("checkpoints.ibckpt.io", "checkpointjobs.ibckpt.io,restorejobs.ibckpt.io,pods", STORAGES):
        cluster.kubectl("delete", kinds, "--all", "-n", job_ns, "--timeout=180s", timeout=200)
    assert _grants(cluster, job_ns) == ["role", "rolebinding"], "no storage grant was made"


def _restored_with_their_own_shim(installed: Release, job_ns: str, old_shim: str) -> None:
    """Each node keeps the old shim build beside the new release's current one, and the restored
    containers mount the old build their processes mapped when they were checkpointed."""
    cluster = installed.cluster
    for agent in installed.agent_pods():
        if agent["metadata"].get("deletionTimestamp"):
            continue
        name, node = agent["metadata"]["name"], agent["spec"]["nodeName"]
        listed = cluster.kubectl(
            "exec", "-n", NAMESPACE, name, "--", "sh", "-c",
            f"ls {HOST_LIB}/builds; cat /host/etc/ibckpt/node.json",
        ).stdout  # fmt: skip
        builds, config = listed.split("{", 1)
        current = json.loads("{" + config)["shim"]
        assert old_shim in builds.split() and len(builds.split()) >= 2, (node, listed)
        assert old_shim not in current, f"{node}'s current shim is still the old build: {current}"
    for member in ring.MEMBERS:
        mapped = cluster.kubectl("exec", "-n", job_ns, member, "--", "sha256sum", IN_SHIM).stdout
        assert mapped.split()[0] == old_shim, (member, mapped)


def test_an_upgrade_mid_checkpoint_a_missing_prerequisite_then_helm_uninstall(
    installed: Release, job_ns: str
) -> None:
    cluster = installed.cluster
    _upgrade_during_a_checkpoint(installed, job_ns)
    pods.namespace(cluster, NS)
    # a pod of no class on each node, running through the whole story
    for node in NODE_NAMES:
        idle = pods.image_pod(f"idle-{node}", node, APPS_IMAGE, [])
        idle["spec"]["containers"][0]["command"] = ["sleep", "100000"]
        pods.apply(cluster, NS, idle)
    before = {}
    for node in NODE_NAMES:
        status = pods.wait_pod(cluster, NS, f"idle-{node}", {"Running"})["status"]
        before[node] = status["containerStatuses"][0]["containerID"]

    # 1. The agents are told to hand calls to a runtime the nodes lack: the first one rolled stays not
    #    Ready, names the missing piece in an Event on its Node, and takes its node's label away.
    helm(
        cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
        "--set", "agent.nextRuntime=/nonexistent/runc",
    )  # fmt: skip
    missing = _wait(
        "an Event NodePrerequisiteMissing naming the runtime",
        lambda: [e for e in _events(cluster, REASON_MISSING) if "/nonexistent/runc" in e["message"]],
    )
    node = missing[0]["involvedObject"]["name"]
    assert missing[0]["involvedObject"]["kind"] == "Node" and missing[0]["type"] == "Warning", missing[0]
    agent = _wait(
        f"the new agent on {node}",
        lambda: [
            p
            for p in installed.agent_pods()
            if p["spec"]["nodeName"] == node and "/nonexistent/runc" in json.dumps(p["spec"]["containers"][0])
        ],
    )[0]
    ready = {c["type"]: c["status"] for c in agent["status"].get("conditions", [])}
    assert ready.get("Ready") != "True", agent["status"]
    labels = pods.get(cluster, NS, "node", node)["metadata"]["labels"]
    assert READY_LABEL not in labels, labels
    log = installed.cluster.kubectl("logs", "-n", NAMESPACE, agent["metadata"]["name"]).stdout
    assert "/nonexistent/runc" in log and "lacks what the ibckpt agent needs" in log, log[-2000:]

    # 2. helm uninstall: its pre-delete hook has every agent undo its node. The agents' storage grants,
    #    which Helm does not know, go with the agents' ClusterRole that owns them.
    installed.uninstall()
    _wait(
        "the storage grants gone with their owner",
        lambda: not _grants(cluster, job_ns),
        timeout=120,
    )
    for name in NODE_NAMES:
        labels = pods.get(cluster, NS, "node", name)["metadata"]["labels"]
        assert READY_LABEL not in labels, labels
        seen = _node_view(cluster, name)
        config, files = seen.split("=== files", 1)
        stock = (cluster.node_dirs[name] / "containerd-config.stock.toml").read_text()
        assert config == stock, f"{name}'s containerd config after uninstall:\n{config}"
        assert "present" not in files, files
    removed = {e["involvedObject"]["name"] for e in _events(cluster, "RuntimeHandlerRemoved")}
    assert removed == set(NODE_NAMES), removed
    # the pods of no class never noticed: the same containers, never restarted
    for name in NODE_NAMES:
        status = pods.get(cluster, NS, "pod", f"idle-{name}")["status"]
        [container] = status["containerStatuses"]
        assert status["phase"] == "Running" and container["restartCount"] == 0, status
        assert container["containerID"] == before[name]
    pods.delete_namespace(cluster, NS)
