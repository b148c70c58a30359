"""Recovery: the watches that wake a protected schedule's controller when its job may have failed (a
Node's readiness, deletion or out-of-service taint changed; a pod Failed or a container exited
non-zero). The controller itself decides (drivers/recovery.py); this only pokes it. docs/recovery.md."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from ibckpt_operator.cluster import recovery
from ibckpt_operator.drivers.schedule import CONTROLLERS

log = logging.getLogger(__name__)

# Node name -> (ready, out of service) as last seen: only a change pokes.
SEEN: dict[str, tuple[bool, bool]] = {}


def _poke(namespace: str | None = None) -> None:
    for controller in list(CONTROLLERS.values()):
        if controller.recovery.watching and namespace in (None, controller.namespace):
            controller.poke()


@kopf.on.event("v1", "nodes")
async def node_health_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    name = body.get("metadata", {}).get("name")
    if not name:
        return
    if type == "DELETED":
        SEEN.pop(name, None)
        log.info("node %s was deleted", name)
        _poke()
        return
    health = recovery.node_health(name, body)
    now = (health.ready, health.out_of_service)
    if SEEN.get(name) == now:
        return
    SEEN[name] = now
    _poke()


def _failing(body: kopf.Body, **_: Any) -> bool:
    health = recovery.pod_health(body)
    return health.phase == "Failed" or health.failed_exit is not None


@kopf.on.event("v1", "pods", when=_failing)
async def pod_failed(body: kopf.Body, **_: Any) -> None:
    _poke(body.get("metadata", {}).get("namespace"))
