"""Judgements on the pod and node objects the drivers read (plain dicts from kube.py): whether a job's pod
is still the one it holds, why a pod failed, whether a node takes pods, which restore created a pod."""

from __future__ import annotations

from typing import Any

from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.machine import PodRef
from ibckpt_operator.machine.podtemplate import RESTORED_BY


def gone(body: Body | None, pod: PodRef, called: str) -> str | None:
    """Why the member's pod (`called` so in the message) is no longer its own: deleted or replaced by one of
    another uid, or being deleted; None while it still is."""
    meta: dict[str, Any] = (body or {}).get("metadata", {})
    if body is None or meta.get("uid") != pod.uid:
        return f"{called} was deleted"
    if meta.get("deletionTimestamp"):
        return f"{called} is being deleted"
    return None


def restored_lost(body: Body | None, pod: PodRef) -> str | None:
    """Why a restored pod is lost to its RestoreJob: gone, or failed (in the runtime's words)."""
    called = f"the restored pod {pod.name}"
    why = gone(body, pod, called)
    if why is None and body is not None and body.get("status", {}).get("phase") == "Failed":
        return f"{called} failed: {failure(body['status'])}"
    return why


def failure(status: dict[str, Any]) -> str:
    """Why a pod failed, in the runtime's words: a container that could not be restored has no pod-level
    message, only its own terminated (or waiting) state, e.g. StartError: ... criu failed ..."""
    if status.get("message") or status.get("reason"):
        return str(status.get("message") or status.get("reason"))
    for container in status.get("containerStatuses") or ():
        for state in ("terminated", "waiting"):
            found = (container.get("state") or {}).get(state) or {}
            if found.get("reason") or found.get("message"):
                said = ": ".join(str(found[k]) for k in ("reason", "message") if found.get(k))
                return f"container {container.get('name')}: {said}"
    return "no reason given by the kubelet"


def ready_condition(body: Body) -> bool:
    """The pod's or node's condition Ready is True."""
    conditions = (body.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def node_ready(node: Body) -> bool:
    """The node is Ready and schedulable (not cordoned)."""
    return ready_condition(node) and not node.get("spec", {}).get("unschedulable")


def restore_marker(body: Body) -> str | None:
    """The run marker of the restore that created this pod (podtemplate.RESTORED_BY), if any."""
    annotations = body.get("metadata", {}).get("annotations") or {}
    marker = annotations.get(RESTORED_BY)
    return None if marker is None else str(marker)
