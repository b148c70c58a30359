"""Source pods on their way out, and how a restore stops waiting for them.

A restored pod takes its source's name, so it can only be created once the source is gone from the API.
A deleted pod stays there until its kubelet has cleaned up after it (volumes, sandbox, cgroups), which on
a slow node takes a minute after its processes ended. Once the kubelet itself reports every container of
a pod being deleted as terminated, nothing of the pod runs any more, so the restore completes the
removal (a delete with grace 0, bound to the pod's uid) rather than wait. A pod that is not being
deleted, or that still has a container not reported terminated, is never touched.
"""

from __future__ import annotations

from ibckpt_operator.kube import Body, Kube


def ended_and_going(pod: Body, uid: str) -> bool:
    """This source pod (by uid) is being deleted and its kubelet reports every container terminated."""
    meta = pod.get("metadata", {})
    if meta.get("uid") != uid or not meta.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    containers = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    return bool(containers) and all("terminated" in (c.get("state") or {}) for c in containers)


async def remove_if_ended(kube: Kube, namespace: str, pod: Body, uid: str) -> bool:
    """Complete the deletion of source `uid` if it has ended (ended_and_going); True if this call did."""
    if not ended_and_going(pod, uid):
        return False
    await kube.delete_pod(namespace, pod["metadata"]["name"], uid, grace_seconds=0)
    return True


def removed_message(name: str) -> str:
    return (
        f"source pod {name} had ended (its kubelet reports every container terminated): its removal was "
        "completed so that the restore need not wait for the node's cleanup"
    )
