"""What the agent writes to its Node object: the runtime-ready label and Events (pure bodies)."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

# The one definition of the label: the agent sets it once the handler works on the node and removes
# it otherwise; the chart's RuntimeClass selects nodes by it (templates/runtimeclass.yaml).
RUNTIME_READY_LABEL = "ibckpt.io/runtime-ready"
RUNTIME_READY_VALUE = "true"

REASON_MISSING = "NodePrerequisiteMissing"
REASON_READY = "RuntimeHandlerReady"
REASON_FAILED = "RuntimeHandlerFailed"
REASON_REMOVED = "RuntimeHandlerRemoved"
COMPONENT = "ibckpt-agent"
MAX_MESSAGE = 1024  # the apiserver refuses an Event message over 1 kB


def label_patch(ready: bool) -> dict[str, Any]:
    """A merge patch: the label set, or removed (null removes a key in a JSON merge patch)."""
    return {"metadata": {"labels": {RUNTIME_READY_LABEL: RUNTIME_READY_VALUE if ready else None}}}


def is_labelled(node: dict[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return labels.get(RUNTIME_READY_LABEL) == RUNTIME_READY_VALUE


def event_body(
    node: str, node_uid: str, reason: str, message: str, now: datetime, warning: bool = True
) -> dict[str, Any]:
    """A core/v1 Event about the Node (events live in the default namespace for cluster objects).
    The name is stable per node, reason and message, so a restarted agent repeats no new one."""
    digest = hashlib.sha256(f"{reason}\0{message}".encode()).hexdigest()[:10]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{node}.ibckpt.{reason.lower()}.{digest}", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid},
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
