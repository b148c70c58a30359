"""Which pods a CheckpointJob means: by label selector, or by the workload that owns them.

The owner walk follows ownerReferences upward from each pod of the namespace (a JobSet owns Jobs that own
pods; a StatefulSet or an MPIJob owns its pods), so any kind works without knowing it in advance.
"""

from __future__ import annotations

from typing import Any

from ibckpt.api import LabelSelector, WorkloadReference
from ibckpt_operator.cluster.kube import Body, Kube
from ibckpt_operator.machine import PodRef
from ibckpt_operator.machine.podtemplate import controller_reference

MAX_OWNER_DEPTH = 4


def selector_string(selector: LabelSelector) -> str:
    """A label selector in the apiserver's query syntax."""
    parts = [f"{key}={value}" for key, value in sorted((selector.match_labels or {}).items())]
    for rule in selector.match_expressions or ():
        values = ",".join(rule.values or ())
        if rule.operator == "In":
            parts.append(f"{rule.key} in ({values})")
        elif rule.operator == "NotIn":
            parts.append(f"{rule.key} notin ({values})")
        elif rule.operator == "Exists":
            parts.append(rule.key)
        else:
            parts.append(f"!{rule.key}")
    return ",".join(parts)


def _live(pod: Body) -> bool:
    meta = pod.get("metadata", {})
    phase = pod.get("status", {}).get("phase")
    return not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


def pod_ref(pod: Body) -> PodRef:
    meta = pod.get("metadata", {})
    return PodRef(meta.get("name", ""), meta.get("uid", ""), pod.get("spec", {}).get("nodeName") or "")


def _matches(ref: dict[str, Any], workload: WorkloadReference) -> bool:
    if ref.get("kind") != workload.kind or ref.get("name") != workload.name:
        return False
    if workload.api_version is None:
        return True
    wanted = workload.api_version
    # "kubeflow.org" matches any version of that group; "batch/v1" must match exactly.
    return ref.get("apiVersion") == wanted or ref.get("apiVersion", "").split("/")[0] == wanted


async def _owned_by(kube: Kube, namespace: str, body: Body, workload: WorkloadReference, depth: int) -> bool:
    for ref in body.get("metadata", {}).get("ownerReferences") or ():
        if _matches(ref, workload):
            return True
        if depth < MAX_OWNER_DEPTH:
            owner = await kube.get_object(
                ref.get("apiVersion", ""), ref.get("kind", ""), namespace, ref["name"]
            )
            same = owner is not None and owner.get("metadata", {}).get("uid") == ref.get("uid")
            if same and owner is not None and await _owned_by(kube, namespace, owner, workload, depth + 1):
                return True
    return False


def controller_uid(pod: Body, skip_kinds: frozenset[str] = frozenset()) -> str:
    """The uid of the pod's controller ownerReference ("" without one, or of a kind in `skip_kinds`)."""
    ref = controller_reference(pod)
    return "" if ref is None or ref.get("kind") in skip_kinds else str(ref.get("uid") or "")


async def select_pods(
    kube: Kube,
    namespace: str,
    selector: LabelSelector | None,
    workload: WorkloadReference | None,
    controllers: dict[str, str] | None = None,
    skip_kinds: frozenset[str] = frozenset(),
) -> tuple[PodRef, ...]:
    """The live pods of the job, sorted by name, pinned by UID. With `controllers`, also each pod's
    controller uid by pod uid (controllers of `skip_kinds` left out)."""
    pods = await workload_pods(kube, namespace, selector, workload)
    live = [pod for pod in pods if _live(pod)]
    if controllers is not None:
        for pod in live:
            if uid := controller_uid(pod, skip_kinds):
                controllers[pod["metadata"]["uid"]] = uid
    return tuple(sorted((pod_ref(pod) for pod in live), key=lambda ref: ref.name))


async def workload_pods(
    kube: Kube, namespace: str, selector: LabelSelector | None, workload: WorkloadReference | None
) -> list[Body]:
    """Every pod of the job in the API, live or not (a failed or terminating one too)."""
    if selector is not None:
        pods = await kube.list_pods(namespace, selector_string(selector))
    else:
        assert workload is not None
        pods = [
            pod
            for pod in await kube.list_pods(namespace)
            if pod.get("metadata", {}).get("ownerReferences")
            and await _owned_by(kube, namespace, pod, workload, 1)
        ]
    return list(pods)
