"""An MPI job in pods, laid out the way the MPI Operator lays one out: an MPIJob `jacobi` owns a launcher pod
and a worker pod (`runLauncherAsWorker`: the launcher's mpirun also runs rank 0). Open MPI over UCX on
rxe runs tests/mpi/jacobi.c, whose result is deterministic. The testbed runs no MPI Operator: the test
creates the pods with the ownerReferences its controller would give them, from a minimal MPIJob CRD.

The pods share their nodes' network (hostNetwork, as MPI jobs on RoCE often run): mpirun reaches the
worker's exec server (tests/mpi/rexec.py, in place of the worker's sshd) and its orted at the node's
address, and a restore on other nodes maps those addresses. The testbed's nodes have no sshd and no
cluster DNS, so the launcher is given the worker's address.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from testbed import pods
from testbed.cluster import Cluster, node_ip
from testbed.images import APPS_IMAGE

NAME = "jacobi"
LAUNCHER = "jacobi-launcher"
WORKER = "jacobi-worker-0"
MEMBERS = (LAUNCHER, WORKER)
GROUP = "kubeflow.org"
VERSION = "v2beta1"
STEPS = 2000
# Rank 0 sleeps this long per step until /tmp/fast exists in the launcher: a window of STEPS x 60 ms for
# the checkpoint to land mid-run, and a quick finish once the test says so.
SLEEP_MS = 60
FAST = "/tmp/fast"
ROOT_OK = "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
# The settings docs/mpi.md found for Open MPI's UCX PML on rxe; tcp first among UCX's connection
# managers keeps UCX from holding an rdma_cm fd the shim does not manage. Multi-rail: UCX opens both
# HCAs of each node (rxe0, rxe1, each on its own link) and may spread a message over two lanes.
RAILS = ("rxe0", "rxe1")
UCX = (
    "--mca pml ucx --mca pml_ucx_devices any --mca osc ucx --mca btl self "
    f"-x UCX_NET_DEVICES={','.join(f'{d}:1' for d in RAILS)} -x UCX_MAX_EAGER_RAILS=2 "
    "-x UCX_MAX_RNDV_RAILS=2 -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_UD_ETH_DGID_CHECK=n "
    "-x UCX_SOCKADDR_TLS_PRIORITY=tcp"
)
_RESULT = re.compile(r"^RESULT .*$", re.MULTILINE)
_STEP = re.compile(r"^step (\d+) residual", re.MULTILINE)


def crd() -> dict[str, Any]:
    """The MPIJob resource, as much of it as the testbed needs: any spec is kept."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"mpijobs.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "mpijobs", "singular": "mpijob", "kind": "MPIJob"},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def install_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(crd()))
    cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/mpijobs.{GROUP}", "--timeout=60s", timeout=80
    )


def _template(name: str, role: str, command: str) -> dict[str, Any]:
    pod = pods.rdma_pod(name, "", ["sh", "-c", command], APPS_IMAGE, host_network=True, labels=labels(role))
    del pod["spec"]["nodeName"]
    pod["spec"]["runtimeClassName"] = "ibckpt"
    pod["spec"]["containers"][0]["env"] = [
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
    ]
    return pod


def labels(role: str) -> dict[str, str]:
    return {"training.kubeflow.org/job-name": NAME, "training.kubeflow.org/job-role": role}


WORKER_COMMAND = 'exec python3 /usr/local/bin/rexec.py serve --bind "$HOST_IP"'


def launcher_command(worker_ip: str) -> str:
    """mpirun, once the worker's exec server answers (the MPI Operator's launcher waits for its workers)."""
    return (
        f"until python3 /usr/local/bin/rexec.py {worker_ip} true; do sleep 2; done; "
        f'{ROOT_OK}; mpirun -np 2 --host "$HOST_IP:1,{worker_ip}:1" '
        '--mca plm_rsh_agent "python3 /usr/local/bin/rexec.py" --mca oob_tcp_if_include 10.77.0.0/24 '
        f"{UCX} jacobi -n {STEPS} -s {SLEEP_MS} -f {FAST}; echo mpirun-exit=$?"
    )


def mpijob() -> dict[str, Any]:
    """The MPIJob as a user writes it (kubeflow.org/v2beta1): one worker, the launcher runs rank 0."""
    launcher, worker = _template(LAUNCHER, "launcher", ""), _template(WORKER, "worker", WORKER_COMMAND)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "MPIJob",
        "metadata": {"name": NAME},
        "spec": {
            "slotsPerWorker": 1,
            "runLauncherAsWorker": True,
            "mpiImplementation": "OpenMPI",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": launcher["spec"]}},
                "Worker": {"replicas": 1, "template": {"spec": worker["spec"]}},
            },
        },
    }


def _owned(pod: dict[str, Any], owner: dict[str, Any], node: str) -> dict[str, Any]:
    """A pod as the MPI Operator's controller creates it: owned by the MPIJob, placed on `node`."""
    meta = owner["metadata"]
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MPIJob", "name": meta["name"], "uid": meta["uid"],
         "controller": True}
    ]  # fmt: skip
    pod["spec"]["nodeName"] = node
    return pod


def start(cluster: Cluster, namespace: str) -> None:
    """The MPIJob, its worker on node-2 and its launcher on node-1, created together (the worker shares
    node-2's address); returns once jacobi runs its steps."""
    pods.apply(cluster, namespace, mpijob())
    owner = pods.get(cluster, namespace, "mpijob", NAME)
    worker = _owned(_template(WORKER, "worker", WORKER_COMMAND), owner, "node-2")
    launcher = _owned(_template(LAUNCHER, "launcher", launcher_command(node_ip(2))), owner, "node-1")
    pods.apply(cluster, namespace, worker, launcher)
    assert pods.wait_pod(cluster, namespace, WORKER, {"Running"})["status"]["podIP"] == node_ip(2)
    pods.wait_pod(cluster, namespace, LAUNCHER, {"Running"})
    deadline = time.monotonic() + 240
    while not steps(log(cluster, namespace)):
        assert time.monotonic() < deadline, f"jacobi ran no step in 240 s:\n{log(cluster, namespace)[-3000:]}"
        time.sleep(3)


def log(cluster: Cluster, namespace: str, name: str = LAUNCHER) -> str:
    found = cluster.kubectl("logs", "-n", namespace, name, check=False)
    return found.stdout + found.stderr


def steps(text: str) -> list[int]:
    """The steps rank 0 reported (every 50th)."""
    return [int(n) for n in _STEP.findall(text)]


def progress(cluster: Cluster, namespace: str, beyond: int, timeout: float = 240) -> int:
    """Wait until rank 0 reports a step past `beyond` (the job computes again); the last step reported."""
    deadline = time.monotonic() + timeout
    while True:
        seen = steps(text := log(cluster, namespace))
        if seen and max(seen) > beyond:
            return max(seen)
        assert time.monotonic() < deadline, f"no step past {beyond} in {timeout:g} s:\n{text[-3000:]}"
        time.sleep(3)


def result(text: str) -> str | None:
    found = _RESULT.findall(text)
    return found[-1] if found else None


REFERENCE = "jacobi-reference"


def start_uninterrupted(cluster: Cluster, namespace: str) -> None:
    """A run of the same binary with no RDMA and no ibckpt, for its RESULT: two ranks in one plain pod on
    node-2, over shared memory. It runs beside the job (read it with `uninterrupted` before a drain)."""
    command = f"{ROOT_OK}; mpirun -np 2 --oversubscribe --mca pml ob1 --mca btl self,vader jacobi -n {STEPS}"
    pod = pods.rdma_pod(REFERENCE, "node-2", ["sh", "-c", command], APPS_IMAGE, host_network=False)
    pods.apply(cluster, namespace, pod)


def uninterrupted(cluster: Cluster, namespace: str) -> str:
    """The RESULT of the run `start_uninterrupted` began, once it ends; its pod is then deleted."""
    pods.wait_pod(cluster, namespace, REFERENCE, {"Succeeded"}, timeout=600)
    found = result(log(cluster, namespace, REFERENCE))
    assert found, log(cluster, namespace, REFERENCE)[-3000:]
    cluster.kubectl("delete", "pod", REFERENCE, "-n", namespace, "--wait=false")
    return found


def finish(cluster: Cluster, namespace: str) -> str:
    """Let the rest of the run go at full speed; wait for mpirun to end; the launcher's log since it was
    (re)started."""
    cluster.kubectl("exec", "-n", namespace, LAUNCHER, "--", "touch", FAST)
    pods.wait_pod(cluster, namespace, LAUNCHER, {"Succeeded"}, timeout=600)
    return log(cluster, namespace)
