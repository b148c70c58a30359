"""Several verbs processes per pod, several pods per node: their virtual QP numbers stay apart (issue 29).

Each pod of this workload runs PROCESSES copies of `many_qps` (native/tests/many_qps.c) under one `sh`:
each makes FIRST_QPS RC QPs, then MORE_QPS more on every SIGUSR1. Processes checkpointed on one node
share that node's GIDs as their virtual ones, so a QP one makes after a rebuild or a restore must not
take a virtual QPN a sibling holds (docs/native-shim.md, "Virtual ids"). The test reads every process's
own shim `status` from inside its pod (`kubectl exec`), as the control protocol allows the container's
user (docs/wire-formats.md), and checks:
  - no two processes of one source node hold one virtual (GID, QPN): processes on different HCAs of one
    node (the perftest story: rxe0 and rxe1) may hold one number, as they do natively;
  - each was told, before its rebuild, exactly the virtual QPNs of its siblings that share a GID with
    it (`reserved_qpns`, sent by the node agent: runtime-hook/ibckpt_node/qpn_reserve.py);
  - the QPs made after the rebuild keep their real QPN as their virtual one (peers reach them as they
    are), and none is a number a sibling holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from testbed import pods
from testbed.cluster import Cluster
from testbed.images import APPS_IMAGE

PROCESSES = 4  # per pod
FIRST_QPS = 4
MORE_QPS = 2
TAKEN = "was taken (a live virtual QPN here or a sibling's)"  # native/src/qp.c, when it asked again

# In the pod: every shim's status before, then (with --more) SIGUSR1 to each many_qps and every status
# again once each has made its new QPs. One JSON line per process and moment.
STATUS = r"""
import glob, json, os, signal, socket, sys, time

def ask():
    found = {}
    for path in sorted(glob.glob("/run/ibckpt/ctl/*.sock")):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(path)
            s.sendall(b"status\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                reply += chunk
        verdict, _, body = reply.decode().partition(" ")  # "ok <json>" (docs/wire-formats.md)
        if verdict != "ok":
            sys.exit(f"{path}: status answered {reply!r}")
        status = json.loads(body)
        found[status["pid"]] = status
    return found

before = ask()
for pid, status in before.items():
    print("BEFORE", json.dumps(status))
if sys.argv[1:2] == ["--more"]:
    more = int(sys.argv[2])
    mine = [int(p) for p in os.listdir("/proc") if p.isdigit()
            and open(f"/proc/{p}/comm").read().strip() == "many_qps"]
    for pid in mine:
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while True:
        after = ask()
        if all(len(after[p]["qps"]) >= len(before[p]["qps"]) + more for p in mine):
            break
        if time.monotonic() > deadline:
            sys.exit("no new QPs within 120 s")
        time.sleep(1)
    for pid, status in after.items():
        print("AFTER", json.dumps(status))
"""


def pod(
    name: str, node: str, labels: dict[str, str], processes: int = PROCESSES, then: str = "wait"
) -> dict[str, Any]:
    """`processes` many_qps in the background, then the shell command `then` in the foreground."""
    command = " ".join(f"many_qps -n {FIRST_QPS} -f /never -Q {MORE_QPS} &" for _ in range(processes))
    spec = pods.rdma_pod(name, node, ["sh", "-c", f"{command} {then}"], APPS_IMAGE, labels=labels)
    spec["spec"]["runtimeClassName"] = "ibckpt"
    return spec


def ready(cluster: Cluster, namespace: str, name: str, processes: int = PROCESSES) -> bool:
    return cluster.kubectl("logs", "-n", namespace, name).stdout.count("READY pid=") == processes


Statuses = dict[str, dict[str, Any]]  # "pod/pid" -> the shim's status


def statuses(
    cluster: Cluster, namespace: str, names: Iterable[str], more: Iterable[str] = ()
) -> tuple[Statuses, Statuses]:
    """Every process's status in the pods `names`, before and after the pods `more` made new QPs (the
    pods not in `more` are read once: after is before)."""
    making = set(more)

    def read(name: str) -> tuple[str, str]:
        args = ["exec", "-n", namespace, name, "--", "python3", "-c", STATUS]
        args += ["--more", str(MORE_QPS)] if name in making else []
        return name, cluster.kubectl(*args, timeout=240).stdout

    before: Statuses = {}
    after: Statuses = {}
    with ThreadPoolExecutor(max_workers=6) as pool:
        for name, out in pool.map(read, sorted(names)):
            for line in out.splitlines():
                when, _, text = line.partition(" ")
                status = json.loads(text)
                (before if when == "BEFORE" else after)[f"{name}/{status['pid']}"] = status
            if name not in making:
                after.update({k: v for k, v in before.items() if k.startswith(f"{name}/")})
    return before, after


def held(status: Mapping[str, Any]) -> set[int]:
    return {int(q["qpn"]) for q in status["qps"]}


def gids(status: Mapping[str, Any]) -> set[str]:
    """The process's virtual GIDs (an all-zero one is an unset table entry): a QPN names a QP only
    together with a GID, so two processes on different HCAs may both hold one number."""
    return {g for g in status["gids"] if int(g, 16)}


def assert_apart(group: str, before: Statuses, after: Statuses) -> int:
    """The processes of one source node (`before`: as they were rebuilt, `after`: with their new QPs):
    none holds a (GID, QPN) another holds, each was told its siblings' QPNs (those sharing a GID with
    it), new QPs at their real numbers. Returns the count of new QPs."""
    assert before and set(before) == set(after), (group, sorted(before), sorted(after))
    owner: dict[tuple[str, int], str] = {}
    for key, status in after.items():
        for g in gids(status):
            for q in held(status):
                assert (g, q) not in owner, f"{group}: {owner[g, q]} and {key} both hold virtual QP {g}/{q}"
                owner[g, q] = key
    made = 0
    for key, status in before.items():
        theirs: set[int] = set()
        for k, other in before.items():
            if k != key and gids(other) & gids(status):
                theirs |= held(other)
        assert status["reserved_qpns"] == len(theirs), (group, key, status["reserved_qpns"], len(theirs))
        real = {int(q["qpn"]): int(q["real_qpn"]) for q in after[key]["qps"]}
        new = held(after[key]) - held(status)
        assert all(real[q] == q for q in new), (group, key, sorted(new), real)
        assert not new & theirs, (group, key, sorted(new & theirs))
        made += len(new)
    return made
