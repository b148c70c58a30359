"""What every handler shares in one operator process: the API client, the agents, the coordinator, the
pod claims and the Lease. Made by the startup handler, dropped by the cleanup handler."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from ibckpt_operator.cluster.agents import AgentGateway
from ibckpt_operator.cluster.kube import Kube
from ibckpt_operator.cluster.leader import LeaderLease
from ibckpt_operator.config import current
from ibckpt_operator.coordinator.server import CoordinatorServer
from ibckpt_operator.machine import PodClaims


@dataclass
class Runtime:
    kube: Kube
    gateway: AgentGateway
    coordinator: CoordinatorServer
    claims: PodClaims = field(default_factory=PodClaims)
    lease: LeaderLease | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # the Lease is gone: stop driving jobs
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # detached work, held until it ends

    def coordinator_address(self) -> str:
        return f"{advertised_host()}:{self.coordinator.port}"

    def detach(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` past the end of the job that started it (a job's own tasks end with its daemon):
        for clean-up whose outcome the job does not wait for, only reports."""
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def advertised_host() -> str:
    """Where agents reach this operator: the configured host, the pod's IP (downward API), or the address
    the default route leaves from."""
    configured = current().coordinator_host or os.environ.get("POD_IP", "")
    if configured:
        return configured
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


_runtime: Runtime | None = None


def get() -> Runtime:
    if _runtime is None:
        raise RuntimeError("the operator has not started (no startup handler ran)")
    return _runtime


def set_runtime(runtime: Runtime | None) -> None:
    global _runtime
    _runtime = runtime


# The Lease a starting replica waits for (the startup handler's), until it leads.
_awaited: LeaderLease | None = None


def awaiting(lease: LeaderLease | None) -> None:
    global _awaited
    _awaited = lease


@dataclass(frozen=True)
class Standing:
    """What this replica is, for the health endpoints: alive (liveness), ready (readiness), and why."""

    alive: bool
    ready: bool
    message: str


def standing() -> Standing:
    """A leader is alive and ready until it loses the Lease. A standby is alive while it waits, and ready
    while the apiserver answers it, so that it can take over: a rolling update of the Deployment needs
    its new pods Ready while the old leader still holds the Lease."""
    if _runtime is not None:
        if _runtime.lost.is_set():
            return Standing(False, False, "this replica lost the operator Lease")
        return Standing(True, True, "leader")
    if _awaited is not None:
        able, why = _awaited.standby_state()
        return Standing(True, able, why)
    return Standing(True, False, "starting")
