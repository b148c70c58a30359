"""A restore's decisions that need no cluster: which node each pod goes to, and whether a node can
restore what the checkpoint requires. Pure functions over plain values (the driver reads the nodes and
agents and hands their facts in)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ibckpt import formats
from ibckpt.api import RequiredVersions
from ibckpt.devicemap import unfit

HOSTNAME_LABEL = "kubernetes.io/hostname"


@dataclass(frozen=True)
class SourcePod:
    name: str
    node: str  # where it was checkpointed
    node_selector: Mapping[str, str] = field(default_factory=dict)  # its template's, if any


class NoNode(Exception):
    """A pod that no allowed node can take; the message names it."""


def placement_selector(node_selector: Mapping[str, str] | None) -> dict[str, str]:
    """The labels a destination must have for a pod: its own nodeSelector without the hostname pin (a
    restore chooses the node; the destination pod drops that pin too)."""
    return {k: v for k, v in (node_selector or {}).items() if k != HOSTNAME_LABEL}


def place_pods(
    pods: Sequence[SourcePod], candidates: Mapping[str, Mapping[str, str]], avoid_source_nodes: bool
) -> dict[str, str]:
    """A destination per pod name among `candidates` (node -> its labels): its source node if allowed
    (its images and addresses stay local), else the least loaded node (ties by name) whose labels match
    the pod's nodeSelector, counting the pods placed so far."""
    load = dict.fromkeys(sorted(candidates), 0)
    placed: dict[str, str] = {}
    for pod in pods:
        wanted = placement_selector(pod.node_selector)
        allowed = [
            node
            for node in load
            if not (avoid_source_nodes and node == pod.node)
            and all(candidates[node].get(k) == v for k, v in wanted.items())
        ]
        if not allowed:
            needs = f" with {', '.join(f'{k}={v}' for k, v in sorted(wanted.items()))}" if wanted else ""
            raise NoNode(f"no Ready node{needs} with a ready ibckpt agent can take pod {pod.name}")
        chosen = pod.node if pod.node in allowed else min(allowed, key=lambda node: (load[node], node))
        placed[pod.name] = chosen
        load[chosen] += 1
    return placed


def release(version: str) -> tuple[int, ...] | None:
    """The leading numbers of a version (`6.1.0-13-amd64` -> (6, 1, 0)); None if it starts with none."""
    match = re.match(r"^v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def newest(versions: Iterable[str | None]) -> str | None:
    """The highest of several nodes' versions (a destination must satisfy every source node)."""
    known = [v for v in versions if v]
    if not known:
        return None
    return max(known, key=lambda v: (release(v) or (), v))


@dataclass(frozen=True)
class NodeFacts:
    """What is known of a destination node: the agent's ibckpt version (AgentInfo.version), the formats
    it reads (AgentInfo.formats; None from an agent before formats) and the kernel
    (Node.status.nodeInfo.kernelVersion). rdma-core and CRIU are reported by neither."""

    ibckpt: str | None = None
    kernel: str | None = None
    reads: Mapping[str, Sequence[int]] | None = None
    shim: str | None = None  # sha256 of its current shim build (AgentInfo.shimSha256)
    shim_builds: Sequence[str] = ()  # every shim build it keeps (AgentInfo.shimBuilds; empty: not reported)
    rdma_devices: Sequence[str] | None = None  # its HCAs (AgentInfo.rdmaDevices; None: not reported)


def incompatibilities(required: RequiredVersions | None, node: NodeFacts) -> list[str]:
    """Why this node cannot restore the checkpoint (empty: it can, as far as anything reports).

    formats: the node's agent must read every format the checkpoint was written in (ibckpt/formats.py),
    whatever the two releases' versions. Only an agent that reports no formats (before they existed) is
    judged by version: the same major.minor while major is 0, else the same major, and at least the
    checkpoint's. shim: a restored process maps its shim build again (CRIU failed on a replaced one), so
    the node must keep the build the checkpoint's processes mapped (an agent before builds were kept:
    its one shim must be that build). kernel: CRIU restores what the
    dumping kernel had, so the destination's major.minor must be at least the checkpoint's. A version
    that does not parse must match exactly."""
    if required is None:
        return []
    problems = []
    if node.reads is not None:
        problems += [
            f"{p} (ibckpt {node.ibckpt or '?'})" for p in formats.unreadable(required.formats, node.reads)
        ]
    elif required.ibckpt and node.ibckpt and not _ibckpt_compatible(required.ibckpt, node.ibckpt):
        problems.append(
            f"its ibckpt agent is {node.ibckpt}, the checkpoint was taken with ibckpt {required.ibckpt}"
        )
    held = set(node.shim_builds) or ({node.shim} if node.shim else set())
    if required.shim and held and required.shim not in held:
        problems.append(
            f"it does not keep shim build {required.shim[:12]}, which the checkpoint's processes mapped "
            f"(it keeps {', '.join(sorted(b[:12] for b in held))}; a restored process maps its shim build "
            "again: restore on a node that kept it, or checkpoint again after restarting the pods)"
        )
    if required.kernel and node.kernel and not _kernel_compatible(required.kernel, node.kernel):
        problems.append(f"its kernel is {node.kernel}, the checkpoint needs {required.kernel} or a newer one")
    return problems


def device_problems(
    used: Mapping[str, Sequence[str]], node: NodeFacts, explicit: Mapping[str, str] | None
) -> list[str]:
    """Why the node's RDMA devices cannot take the devices a pod's containers used (`used`: by the
    container's tree in the checkpoint, as its manifest recorded them): devicemap.unfit per container.
    Nothing is said when the node's agent does not report its devices (the agent checks them anyway)."""
    if node.rdma_devices is None:
        return []
    problems = []
    for container, devices in sorted(used.items()):
        why = unfit(devices, node.rdma_devices, explicit)
        if why:
            problems.append(f"container {container}: {why}")
    return problems


def _ibckpt_compatible(required: str, found: str) -> bool:
    want, have = release(required), release(found)
    if want is None or have is None:
        return required == found
    if want[0] == 0:
        return have[:2] == want[:2] and have >= want
    return have[0] == want[0] and have >= want


def _kernel_compatible(required: str, found: str) -> bool:
    want, have = release(required), release(found)
    if want is None or have is None:
        return required == found
    return have[:2] >= want[:2]


def unchecked(required: RequiredVersions | None) -> list[str]:
    """The required versions nothing on a node reports, so a restore cannot check them."""
    if required is None:
        return []
    return [name for name, value in (("rdmaCore", required.rdma_core), ("criu", required.criu)) if value]


def rank_parts(key: str) -> tuple[str, str, str, str]:
    """job, pod, container, process of a rank key (the agents' RankId); ValueError if it is not one."""
    parts = key.split("/")
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"rank key {key!r} is not job/pod/container/process")
    return parts[0], parts[1], parts[2], parts[3]


@dataclass(frozen=True)
class AddressMove:
    """A hostNetwork pod's node address at the checkpoint and on the node it is restored to."""

    pod: str
    old: str
    new: str


class AddressConflict(Exception):
    """Two hostNetwork pods of one old node go to nodes with different addresses; the message names them."""


def address_map(moves: Iterable[AddressMove]) -> dict[str, str]:
    """The one {old: new} node address map every agent rewrites its images' TCP sockets with, so that a
    hostNetwork pod's connections follow it (and both ends agree again). A pod-network pod has no entry:
    its address is its own and changes anyway, and the agents' preflight refuses its connections to other
    pods. The map must be a function: pods that shared an address must share the new one."""
    found: dict[str, tuple[str, str]] = {}  # old -> (new, the pod that set it)
    for move in moves:
        if not move.old or not move.new:
            continue
        seen = found.setdefault(move.old, (move.new, move.pod))
        if seen[0] != move.new:
            raise AddressConflict(
                f"hostNetwork pods {seen[1]} and {move.pod} both ran on address {move.old} but are restored "
                f"to nodes with different addresses ({seen[0]} and {move.new}), so their TCP "
                "connections cannot follow both: place them on one node (nodeSelector) or avoid fewer nodes"
            )
    return {old: new for old, (new, _) in sorted(found.items()) if old != new}
