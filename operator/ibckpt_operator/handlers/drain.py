"""Drains: the Node watch (a cordon or an autoscaler's drain taint pokes every protected schedule) and the
validating admission webhook on pods/eviction (answered by the schedule's drain machine), served by kopf's
admission server from the operator pod (docs/drains.md).

The webhook server is on in a pod (the apiserver reaches the operator at its pod IP) and off elsewhere;
the environment overrides it (webhook.py). The leader writes the configurations (cluster/admission.py:
failurePolicy Ignore, a short timeout; the PDB is the backstop).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from ibckpt_operator.cluster import admission, drains
from ibckpt_operator.cluster.selection import pod_ref
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.schedule import CONTROLLERS
from ibckpt_operator.machine.core import PodRef
from ibckpt_operator.machine.drain import EvictionAnswer

log = logging.getLogger(__name__)


@kopf.on.event("v1", "nodes")
async def node_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    name = body.get("metadata", {}).get("name")
    if not name:
        return
    draining = type != "DELETED" and drains.node_draining(body)
    if drains.DRAINING.get(name, False) == draining and name in drains.DRAINING:
        return
    drains.DRAINING[name] = draining
    if draining:
        drains.DRAINED_AT[name] = time.time()
        log.info("node %s is being drained", name)
    for controller in list(CONTROLLERS.values()):
        if controller.drain is not None:
            controller.poke()


async def answer_eviction(namespace: str, pod_name: str) -> EvictionAnswer:
    """The answer for an eviction of this pod: the protecting schedule's, or allowed if none protects it
    (or this replica is not running the handlers)."""
    try:
        rt = runtime.get()
    except RuntimeError:
        return EvictionAnswer(True)
    pod = await rt.kube.get_pod(namespace, pod_name)
    if pod is None:
        return EvictionAnswer(True)
    ref: PodRef = pod_ref(pod)
    for controller in list(CONTROLLERS.values()):
        if controller.namespace == namespace and controller.protects(ref.uid):
            return await controller.answer_eviction(ref)
    return EvictionAnswer(True)


@kopf.on.validate(
    "v1", "pods", subresource="eviction", operations=["CREATE"], ignore_failures=True, id=admission.EVICTION
)
async def validate_eviction(body: kopf.Body, dryrun: bool, **_: Any) -> None:
    meta = body.get("metadata") or {}
    if dryrun or not meta.get("name"):
        return
    answer = await answer_eviction(meta.get("namespace") or "default", meta["name"])
    if not answer.allowed:
        raise kopf.AdmissionError(answer.message, code=answer.code)
