"""Source pods on their way out, and how a restore stops waiting for them.

A restored pod takes its source's name, so it can only be created once the source is gone from the API.
A deleted pod stays there until its kubelet has cleaned up after it (volumes, sandbox, cgroups), which on
a slow node takes a minute after its processes ended. The sources here were running when they were
checkpointed; once the kubelet itself reports that no container of such a pod runs any more while it is
being deleted (a kubelet never starts a container of a pod being deleted), nothing of it runs, so the
restore completes the removal (a delete with grace 0, bound to the pod's uid) rather than wait. A pod
that is not being deleted, or that the kubelet still reports running or ready, is never touched.
"""

from __future__ import annotations

from ibckpt_operator.cluster.kube import Body, Kube
from ibckpt_operator.cluster.pods import ready_condition


def ended_and_going(pod: Body, uid: str) -> bool:
    """This source pod (by uid) is being deleted, and its kubelet reports it not ready, with no container
    running. A killed container is `terminated`, or on kubelets before 1.22 `waiting` (ContainerCreating:
    the runtime no longer lists it)."""
    meta = pod.get("metadata", {})
    if meta.get("uid") != uid or not meta.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if ready_condition(pod):
        return False
    containers = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    return bool(containers) and not any("running" in (c.get("state") or {}) for c in containers)


async def remove_if_ended(kube: Kube, namespace: str, pod: Body, uid: str) -> bool:
    """Complete the deletion of source `uid` if it has ended (ended_and_going); True if this call did."""
    if not ended_and_going(pod, uid):
        return False
    await kube.delete_pod(namespace, pod["metadata"]["name"], uid, grace_seconds=0)
    return True


def removed_message(name: str) -> str:
    return (
        f"source pod {name} had ended (its kubelet reports no container running): its removal was "
        "completed so that the restore need not wait for the node's cleanup"
    )
