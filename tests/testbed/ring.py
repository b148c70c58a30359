"""The two-pod RDMA job the operator tests checkpoint, restore and migrate: an unmodified `rc_seq` server in
`ring-0` on node-1 and its client in `ring-1` on node-2, on the pod network, under the `ibckpt` RuntimeClass,
exchanging checked messages until /tmp/stop appears. Started, watched and finished through kubectl, by
tests/helm and `make demo`."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from testbed import pods
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE
from testbed.release import STORAGE_SECRET, Release

# -P: the pair sleeps 2 ms whenever its CQ is empty. Unpaced it busy-polls about a core of each emulated
# node, and every other part of a test (kubelet, containerd, CRIU, the agents) waits for CPU behind it.
PACE = "-P 2000"
SERVER = f"rc_seq -f /tmp/stop -p 18515 {PACE}; echo ring-done"
MEMBERS = ("ring-0", "ring-1")
LABELS = {"app": "ring"}
PRODUCT_NS = "ibckpt-helm"  # where tests/helm (and the demo) install the chart


def results(log: str) -> list[dict[str, str]]:
    """rc_seq's RESULT lines: sent, received, their checksums, bad messages."""
    found = []
    for line in log.splitlines():
        if line.startswith("RESULT "):
            found.append(dict(field.split("=", 1) for field in line.split()[1:]))
    return found


def assert_exactly_once(log: str) -> None:
    """Both ends' RESULTs agree: every message sent was received once, none bad."""
    found = results(log)
    assert len(found) == 2, log[-3000:]
    a, b = found
    assert a["bad"] == b["bad"] == "0", found
    assert a["sent"] == b["received"] and b["sent"] == a["received"], found
    assert a["send_sum"] == b["recv_sum"] and b["send_sum"] == a["recv_sum"], found
    assert int(a["sent"]) > 0 and int(b["sent"]) > 0, found


# A TCP connection the job keeps open for its whole run, as an MPI launcher keeps one to each worker's daemon:
# ring-1 connects to ring-0's port 18600 at the start and says `before`; once /tmp/stop appears it says
# `after` on the same connection and prints `tcp-kept after` when ring-0 echoes it. Anything else (a reset,
# a close, a timeout) ends it with a traceback and no `tcp-kept`.
KEEPER = """
import os, socket, sys, time
if sys.argv[1] == "serve":
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((sys.argv[2], 18600))  # the node's address, from the downward API
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()  # one peer only; nothing listens on the node while the job is moved
    for line in conn.makefile("rb"):
        conn.sendall(line)
    print("keeper-served", flush=True)
else:
    for attempt in range(60):
        try:
            conn = socket.create_connection((sys.argv[2], 18600), timeout=60)
            break
        except ConnectionRefusedError:
            time.sleep(1)
    def ask(word):
        conn.sendall(word.encode() + b"\\n")
        got = b""
        while not got.endswith(b"\\n"):
            chunk = conn.recv(64)
            if not chunk:
                sys.exit("tcp-lost: the connection closed")
            got += chunk
        return got.decode().strip()
    print("keeper-connected", ask("before"), flush=True)
    while not os.path.exists("/tmp/stop"):
        time.sleep(1)
    print("tcp-kept", ask("after"), flush=True)
"""
WRITE_KEEPER = f"echo {base64.b64encode(KEEPER.encode()).decode()} | base64 -d > /tmp/keeper.py"


def member(
    name: str, node: str, command: str, host_network: bool = False, devices: str = "plugin"
) -> dict[str, Any]:
    command_line = ["sh", "-c", command]
    pod = pods.rdma_pod(
        name, node, command_line, APPS_IMAGE, host_network=host_network, labels=LABELS, devices=devices
    )
    pod["spec"]["runtimeClassName"] = "ibckpt"
    return pod


# ring-1 waits for the test to write ring-0's address into its /tmp/server (known once ring-0 runs), so
# that both pods are created at once: a pod's start costs half a minute on the emulated nodes.
AWAIT_SERVER = 'until [ -s /tmp/server ]; do sleep 1; done; server="$(cat /tmp/server)"; sleep 3'


def start(
    cluster: Cluster, namespace: str, host_network: bool = False, devices: str = "plugin", beside: str = ""
) -> None:
    """ring-0 on node-1, ring-1 on node-2; returns once they exchange messages. With `host_network` the pods
    share their nodes' network and ring-1 also keeps a TCP connection to ring-0 (KEEPER) for the whole run.
    `devices`: how the pods get their RDMA devices (pods.rdma_pod). `beside`: a command each pod runs in
    the background for its whole life, next to its rank."""
    server = (
        f'{WRITE_KEEPER}; python3 /tmp/keeper.py serve "$HOST_IP" & {SERVER}; wait'
        if host_network
        else SERVER
    )
    rc_client = f'rc_seq -c "$server" -f /tmp/stop -p 18515 {PACE}; echo ring-done'
    client = f"{AWAIT_SERVER}; {rc_client}"
    if host_network:
        client = f'{WRITE_KEEPER}; {AWAIT_SERVER}; python3 /tmp/keeper.py ask "$server" & {rc_client}; wait'
    if beside:
        server, client = f"{beside} & {server}", f"{beside} & {client}"
    keeper_pod = member("ring-0", "node-1", server, host_network, devices)
    host_ip = {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
    keeper_pod["spec"]["containers"][0].setdefault("env", []).append(host_ip)
    pods.apply(
        cluster,
        namespace,
        keeper_pod,
        member("ring-1", "node-2", client, host_network, devices),
    )
    server_ip = pods.wait_pod(cluster, namespace, "ring-0", {"Running"})["status"]["podIP"]
    pods.wait_pod(cluster, namespace, "ring-1", {"Running"})
    tell_server(cluster, namespace, server_ip)
    connected(cluster, namespace)


# Run in ring-1's node agent (hostPID): SIGKILL to ring-1's container init (the shell) and its rc_seq.
KILL_RANK = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if argv and argv[0].endswith(b"rc_seq") and b"-c" in argv:
        status = open(f"/proc/{pid}/status").read()
        parent = int(status.split("PPid:", 1)[1].split()[0])
        os.kill(parent, signal.SIGKILL)  # the container's init first: its shell never reaps rc_seq
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended with its pid namespace's init
        print("killed", parent, pid)
        break
"""


def kill_rank(release: Release, node: str) -> subprocess.CompletedProcess[str]:
    """SIGKILL ring-1 (the client rank) on `node` from that node's agent, as a crashed rank dies."""
    [agent] = [p for p in release.agent_pods() if p["spec"]["nodeName"] == node]
    return release.cluster.kubectl(
        "exec", "-n", release.namespace, agent["metadata"]["name"], "--",
        "/opt/ibckpt/venv/bin/python", "-c", KILL_RANK, check=False,
    )  # fmt: skip


def running(cluster: Cluster, namespace: str) -> None:
    """Both members still run where they were and the ring has not ended."""
    for name in MEMBERS:
        pod = pods.get(cluster, namespace, "pod", name)
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        assert not results(cluster.kubectl("logs", "-n", namespace, name).stdout), "the ring ended"


def placement(cluster: Cluster, namespace: str) -> dict[str, str]:
    found = pods.get(cluster, namespace, "pods")["items"]
    return {p["metadata"]["name"]: p["spec"]["nodeName"] for p in found}


def finish(cluster: Cluster, namespace: str) -> list[dict[str, str]]:
    """Let the messages flow on the rebuilt queue pairs, stop both, and check every message arrived once;
    returns both ends' RESULTs."""
    time.sleep(5)
    for name in MEMBERS:
        cluster.kubectl("exec", "-n", namespace, name, "--", "touch", "/tmp/stop")
    for name in MEMBERS:
        try:
            pods.wait_pod(cluster, namespace, name, {"Succeeded"}, timeout=300)
        except AssertionError as stuck:  # how the jobs that touched the ranks ended, last (CI shows the end)
            raise AssertionError(
                f"{stuck}\n--- the namespace's jobs\n{job_outcomes(cluster, namespace)}"
            ) from None
    log = "".join(cluster.kubectl("logs", "-n", namespace, name).stdout for name in MEMBERS)
    assert log.count("ring-done") == 2, log[-3000:]
    assert_exactly_once(log)
    return results(log)


def job_outcomes(cluster: Cluster, namespace: str) -> str:
    """Each CheckpointJob and RestoreJob of the namespace: its phase, reason and message."""
    columns = ",".join(
        f"{title}:{path}"
        for title, path in (("KIND", ".kind"), ("NAME", ".metadata.name"), ("PHASE", ".status.phase"),
                            ("REASON", ".status.reason"), ("MESSAGE", ".status.message"))
    )  # fmt: skip
    kinds = "checkpointjobs.ibckpt.io,restorejobs.ibckpt.io"
    found = cluster.kubectl("get", kinds, "-n", namespace, "-o", f"custom-columns={columns}", check=False)
    return (found.stdout + found.stderr)[-3000:]


# The same ring as a StatefulSet `ring`: one template, so each pod's role comes from its hostname; the
# testbed has no cluster DNS, so the client waits for the test to write the server's address in /tmp.
# The container stays up after the ring (a StatefulSet restarts a container that exits).
# Each member first runs verbs processes that come and go, as real pods do (a device check, a connect
# that fails and exits): their control sockets must not stand in the way of a checkpoint (issue 30).
COME_AND_GO = "for i in 1 2 3; do ibv_devinfo >/dev/null; done; ibv_rc_pingpong -g 1 -n 1 127.0.0.1 || true; "
STATEFUL_COMMAND = (
    COME_AND_GO + f'if [ "$(hostname)" = ring-0 ]; then rc_seq -f /tmp/stop -p 18515 {PACE}; '
    "else while [ ! -s /tmp/server ]; do sleep 1; done; "
    f'rc_seq -c "$(cat /tmp/server)" -f /tmp/stop -p 18515 {PACE}; fi; echo ring-done; exec sleep 1000000'
)


def statefulset() -> dict[str, Any]:
    """Two replicas created together, spread over the nodes (preferred: both may end up on one node)."""
    template = member("ring", "", STATEFUL_COMMAND)
    del template["spec"]["nodeName"]
    template["spec"]["restartPolicy"] = "Always"
    spread = {"labelSelector": {"matchLabels": LABELS}, "topologyKey": "kubernetes.io/hostname"}
    template["spec"]["affinity"] = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": spread}]
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "ring"},
        "spec": {
            "serviceName": "ring",
            "replicas": 2,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": LABELS},
            "template": {"metadata": {"labels": LABELS}, "spec": template["spec"]},
        },
    }


def start_statefulset(cluster: Cluster, namespace: str) -> None:
    """The StatefulSet's ring, connected; returns once they exchange messages."""
    pods.apply(cluster, namespace, statefulset())
    deadline = time.monotonic() + 120  # the StatefulSet's controller creates the pods a moment later
    while any(
        cluster.kubectl("get", "pod", name, "-n", namespace, check=False).returncode for name in MEMBERS
    ):
        assert time.monotonic() < deadline, "the StatefulSet created no pods in 120 s"
        time.sleep(1)
    server_ip = pods.wait_pod(cluster, namespace, "ring-0", {"Running"})["status"]["podIP"]
    pods.wait_pod(cluster, namespace, "ring-1", {"Running"})
    tell_server(cluster, namespace, server_ip)
    connected(cluster, namespace)


def tell_server(cluster: Cluster, namespace: str, server_ip: str) -> None:
    """Write ring-0's address where ring-1's command waits for it (the testbed has no cluster DNS)."""
    cluster.kubectl("exec", "-n", namespace, "ring-1", "--", "sh", "-c", f"echo {server_ip} > /tmp/server")


def connected(cluster: Cluster, namespace: str) -> None:
    deadline = time.monotonic() + 180
    while "READY" not in cluster.kubectl("logs", "-n", namespace, "ring-1").stdout:
        assert time.monotonic() < deadline, "the ring did not connect"
        time.sleep(3)
    time.sleep(5)


def finish_statefulset(cluster: Cluster, namespace: str) -> list[dict[str, str]]:
    """finish() for the StatefulSet's ring, whose containers stay up: each says ring-done, none restarted."""
    time.sleep(5)
    for name in MEMBERS:
        cluster.kubectl("exec", "-n", namespace, name, "--", "touch", "/tmp/stop")
    deadline = time.monotonic() + 300
    while True:
        log = "".join(cluster.kubectl("logs", "-n", namespace, name).stdout for name in MEMBERS)
        if log.count("ring-done") == 2 or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert log.count("ring-done") == 2, log[-3000:]
    for name in MEMBERS:
        pod = pods.get(cluster, namespace, "pod", name)
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]
    assert_exactly_once(log)
    return results(log)


# The same ring as two batch Jobs `ring-0` (server, on node-1) and `ring-1` (client, on node-2), the way
# an MPI launcher is a Job beside its workers: each Job names its pod anew (ring-0-xxxxx).
def jobs() -> list[dict[str, Any]]:
    client = f'rc_seq -c "$server" -f /tmp/stop -p 18515 {PACE}; echo ring-done'
    found = []
    for job, node, command in (
        ("ring-0", "node-1", SERVER),
        ("ring-1", "node-2", f"{AWAIT_SERVER}; {client}"),
    ):
        pod = member(job, node, command)
        spec = pod["spec"]
        del spec["nodeName"]
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        found.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": job},
                # the kill after the commit is a failure while its pod exists (restartPolicy Never)
                "spec": {"backoffLimit": 3, "template": {"metadata": {"labels": LABELS}, "spec": spec}},
            }
        )
    return found


def job_pods(cluster: Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    """Each Job's pods (live or not) by name: {job: {pod name: pod}}."""
    found: dict[str, dict[str, Any]] = {name: {} for name in MEMBERS}
    for pod in pods.get(cluster, namespace, "pods")["items"]:
        job = (pod["metadata"].get("labels") or {}).get("job-name")
        if job in found:
            found[job][pod["metadata"]["name"]] = pod
    return found


def start_jobs(cluster: Cluster, namespace: str) -> dict[str, str]:
    """The Jobs' ring, connected; returns each Job's pod name."""
    pods.apply(cluster, namespace, *jobs())
    deadline = time.monotonic() + 120
    while not all(job_pods(cluster, namespace).values()):
        assert time.monotonic() < deadline, "the Jobs created no pods in 120 s"
        time.sleep(1)
    names = {job: next(iter(found)) for job, found in job_pods(cluster, namespace).items()}
    server_ip = pods.wait_pod(cluster, namespace, names["ring-0"], {"Running"})["status"]["podIP"]
    pods.wait_pod(cluster, namespace, names["ring-1"], {"Running"})
    cluster.kubectl(
        "exec", "-n", namespace, names["ring-1"], "--", "sh", "-c", f"echo {server_ip} > /tmp/server"
    )
    deadline = time.monotonic() + 180
    while "READY" not in cluster.kubectl("logs", "-n", namespace, names["ring-1"]).stdout:
        assert time.monotonic() < deadline, "the ring did not connect"
        time.sleep(3)
    time.sleep(5)
    return names


def protect(
    cluster: Cluster,
    namespace: str,
    template: dict[str, Any],
    drain: dict[str, Any] | None = None,
    name: str = "ring",
) -> dict[str, Any]:
    """Apply CheckpointSchedule `name` protecting `template`'s job on drains (KeepHolding, 1500 s unless
    `drain` says otherwise); returns it once its PDB is in place."""
    schedule = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointSchedule",
        "metadata": {"name": name},
        "spec": {
            "drain": drain or {"deadlineSeconds": 1500, "onFailure": "KeepHolding"},
            "template": template,
        },
    }
    pods.apply(cluster, namespace, schedule)
    return wait_phase(
        cluster, namespace, "checkpointschedule", name, f"policy/v1beta1/ibckpt-{name}", 300, "protectedBy"
    )


def drain_node_1(cluster: Cluster, namespace: str, *flags: str) -> str:
    """`kubectl drain node-1 --ignore-daemonsets --delete-emptydir-data [flags]`, which must complete by
    itself (ibckpt holds it, then lets it go); what kubectl printed."""
    drain = cluster.kubectl(
        "drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", *flags, "--timeout=1500s",
        timeout=1560, check=False,
    )  # fmt: skip
    said = drain.stdout + drain.stderr
    assert drain.returncode == 0, f"kubectl drain failed:\n{said[-4000:]}\n{diagnose(cluster, namespace)}"
    return said


Object = dict[str, Any]


def migrated(cluster: Cluster, namespace: str, done: Object) -> tuple[Object, Object, Object]:
    """The CheckpointJob, Checkpoint and RestoreJob of the drain migration a schedule finished (`done`, its
    object at drainPhase Done), once the job is seen to have succeeded in Stop mode and the restore to have
    succeeded away from node-1."""
    migration = done["status"]["migration"]
    job = pods.get(cluster, namespace, "checkpointjob", migration["checkpointJob"])
    assert job["status"]["phase"] == "Succeeded" and job["spec"]["mode"] == "Stop", job["status"]
    checkpoint = pods.get(cluster, namespace, "checkpoint", migration["checkpoint"])
    restore = pods.get(cluster, namespace, "restorejob", migration["restoreJob"])
    assert restore["status"]["phase"] == "Succeeded" and restore["spec"]["avoidNodes"] == ["node-1"]
    return job, checkpoint, restore


def checkpoint_job(name: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": job_template(mode),
    }


def storage(s3_endpoint: str, bucket: str) -> dict[str, Any]:
    """The team's CheckpointStorage `store`: the host's S3 as pods reach it, its credentials Secret."""
    port = s3_endpoint.rsplit(":", 1)[1]
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointStorage",
        "metadata": {"name": "store"},
        "spec": {
            "endpoint": f"http://10.0.2.100:{port}",
            "bucket": bucket,
            "credentialsSecretRef": {"name": STORAGE_SECRET},
        },
    }


def restore_job(name: str, checkpoint: str, device_map: dict[str, str] | None = None) -> dict[str, Any]:
    """A RestoreJob that brings the ring back with each pod off the node it was checkpointed on."""
    spec: dict[str, Any] = {
        "checkpointName": checkpoint,
        "avoidSourceNodes": True,
        "timeouts": {"admitSeconds": 300},
    }
    if device_map is not None:
        spec["deviceMap"] = device_map
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "RestoreJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def job_template(mode: str = "LeaveRunning") -> dict[str, Any]:
    return {
        "selector": {"matchLabels": LABELS},
        "mode": mode,
        "storageRef": {"name": "store"},
        # the testbed's emulated nodes are ~20x slower than real ones: admission took 32 to 60+ s
        "timeouts": {"admitSeconds": 300},
    }


def diagnose(cluster: Cluster, namespace: str, product_ns: str = PRODUCT_NS) -> str:
    """The namespace's Events, the product's recent logs, the agents' errors, each pod's shim lines and,
    last (CI shows a failure's tail), every CheckpointJob's and RestoreJob's outcome: the first one failed
    for the root cause. Repeated lines are shown once."""
    events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    logs = cluster.kubectl(
        "logs", "-n", product_ns, "-l", "app.kubernetes.io/component in (operator,agent)", "--tail=40",
        check=False,
    ).stdout  # fmt: skip
    agents = cluster.kubectl(
        "logs", "-n", product_ns, "-l", "app.kubernetes.io/component=agent", "--tail=1000", check=False
    ).stdout
    errors = _once(line for line in agents.splitlines() if " ERROR " in line or " WARNING " in line)
    # an agent the kubelet restarted (a failed liveness probe) aborts its node's sessions: say so
    product_events = cluster.kubectl(
        "get", "events", "-n", product_ns, "--sort-by=.lastTimestamp", check=False
    ).stdout  # fmt: skip
    unhealthy = _once(
        line
        for line in product_events.splitlines()
        if any(w in line for w in ("Unhealthy", "Killing", "BackOff"))
    )
    restarts = cluster.kubectl(
        "get", "pods", "-n", product_ns, "-o",
        "custom-columns=POD:.metadata.name,NODE:.spec.nodeName,RESTARTS:.status.containerStatuses[0].restartCount",
        check=False,
    ).stdout  # fmt: skip
    shims = []  # what the shim said in each of the namespace's pods (a rebuild's settle counts, say)
    found = cluster.kubectl("get", "pods", "-n", namespace, "-o", "name", check=False).stdout.split()
    for pod in found[:6]:
        said = cluster.kubectl("logs", "-n", namespace, pod, "--all-containers", check=False).stdout
        mine = _once(line for line in said.splitlines() if line.startswith("libibckpt["))
        shims += [f"{pod}: {line}" for line in mine[-8:]]
    outcomes = cluster.kubectl(
        "get", "checkpointjobs,restorejobs", "-n", namespace, "--sort-by=.metadata.creationTimestamp", "-o",
        "custom-columns=NAME:.metadata.name,PHASE:.status.phase,REASON:.status.reason,MESSAGE:.status.message",
        check=False,
    ).stdout  # fmt: skip
    return (
        f"{events[-2500:]}\n{logs[-4000:]}\nagents' warnings and errors:\n{chr(10).join(errors)[-4000:]}\n"
        f"product pods:\n{restarts[-1000:]}\nprobes and restarts:\n{chr(10).join(unhealthy)[-2000:]}\n"
        f"shims:\n{chr(10).join(shims)[-3000:]}\njobs, first to last:\n{outcomes[:2500]}"
    )


def _once(lines: Iterable[str]) -> list[str]:
    """`lines` without repeats (a retried step says the same thing each time), timestamps aside."""
    seen: set[str] = set()
    kept = []
    for line in lines:
        gist = re.sub(r"^\d{4}-\d\d-\d\d \S+ ", "", line)
        if gist not in seen:
            seen.add(gist)
            kept.append(line)
    return kept


def wait_phase(
    cluster: Cluster,
    namespace: str,
    kind: str,
    name: str,
    want: str,
    timeout: float = 900,
    field: str = "phase",
) -> dict[str, Any]:
    """Wait until the object's status.<field> is `want`; fail early on Failed (or an unwanted Succeeded)."""
    deadline = time.monotonic() + timeout
    obj: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        obj = json.loads(found.stdout) if found.returncode == 0 else {}
        value = obj.get("status", {}).get(field)
        if value == want:
            return obj
        if value in ("Failed", "Succeeded"):
            break
        time.sleep(3)
    raise AssertionError(
        f"{kind} {name}: status.{field} is {obj.get('status', {}).get(field)!r}, wanted {want}:\n"
        f"{json.dumps(obj.get('status', {}), indent=1)[-4000:]}\n{diagnose(cluster, namespace)}"
    )


def seconds(obj: dict[str, Any], start: str = "startTime", end: str = "completionTime") -> float:
    """From one status timestamp to another of a finished job."""
    status = obj["status"]
    first, last = (datetime.fromisoformat(status[k].replace("Z", "+00:00")) for k in (start, end))
    return (last - first).total_seconds()
