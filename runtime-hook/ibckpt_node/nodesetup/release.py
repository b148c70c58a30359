"""The chart's pre-delete hook: `python -m ibckpt_node.nodesetup uninstall-release`.

Helm deletes the agents' RBAC with their DaemonSet, so an agent stopped by `helm uninstall` could no
longer reach its Node. This hook runs first, with everything still in place: it deletes the agent
DaemonSet, whose agents then see it gone at SIGTERM and undo their node (lifecycle.uninstall), waits for
them to end, and removes the label from any node whose agent could not (a node that was down).
"""

from __future__ import annotations

import logging
import time

from ibckpt_node.nodesetup import nodeobjects
from ibckpt_node.nodesetup.kube import NodeApi

log = logging.getLogger("ibckpt_node.nodesetup.release")


def uninstall_release(api: NodeApi, namespace: str, daemonset: str, selector: str, timeout_s: float) -> int:
    log.info("deleting DaemonSet %s/%s: its agents undo their nodes as they stop", namespace, daemonset)
    api.delete_daemonset(namespace, daemonset)
    deadline = time.monotonic() + timeout_s
    left = api.pod_names(namespace, selector)
    while left and time.monotonic() < deadline:
        time.sleep(2.0)
        left = api.pod_names(namespace, selector)
    if left:
        log.warning("agents still stopping after %gs: %s", timeout_s, ", ".join(left))
    label = f"{nodeobjects.RUNTIME_READY_LABEL}={nodeobjects.RUNTIME_READY_VALUE}"
    for node in api.node_names(label):
        log.warning("node %s still carries %s (its agent did not remove it): removing it", node, label)
        api.patch_node(node, nodeobjects.label_patch(False))
    return 0  # a failed hook would block the uninstall; what is left is logged above
