"""One active operator at a time: a coordination.k8s.io/v1 Lease, acquired before any handler runs and
renewed while the operator lives. A replica that loses it stops (its jobs' state is in their status; the
next leader resumes them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import kubernetes
from kubernetes.client import ApiException

from ibckpt_operator import metrics
from ibckpt_operator.cluster.kube import Kube

log = logging.getLogger(__name__)
RELEASE_ATTEMPTS = 5


def _now() -> datetime:
    return datetime.now(UTC)


class LeaderLease:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, seconds: float) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.seconds = max(1, int(seconds))
        self.held = False

    def _spec(self, transitions: int, acquired: datetime) -> kubernetes.client.V1LeaseSpec:
        return kubernetes.client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self.seconds,
            acquire_time=acquired,
            renew_time=_now(),
            lease_transitions=transitions,
        )

    def _try(self) -> bool:
        """One attempt to take or renew the Lease; the apiserver's resourceVersion check settles races."""
        api = self.kube.coordination
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise
            body = kubernetes.client.V1Lease(
                metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(0, _now()),
            )
            try:
                api.create_namespaced_lease(self.namespace, body)
                return True
            except ApiException as create_error:
                if create_error.status == 409:
                    return False
                raise
        spec = lease.spec or kubernetes.client.V1LeaseSpec()
        mine = spec.holder_identity == self.identity
        if not mine and spec.holder_identity:
            renewed = spec.renew_time or spec.acquire_time
            duration = spec.lease_duration_seconds or self.seconds
            if renewed is not None and _now() < renewed + timedelta(seconds=duration):
                return False  # someone else holds it and renews it
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        acquired = spec.acquire_time if mine and spec.acquire_time else _now()
        lease.spec = self._spec(transitions, acquired)
        try:
            api.replace_namespaced_lease(self.name, self.namespace, lease)  # 409 if it moved meanwhile
            return True
        except ApiException as error:
            if error.status == 409:
                return False
            raise

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        logged = False
        while True:
            try:
                if await asyncio.to_thread(self._try):
                    self.held = True
                    metrics.LEADER.set(1)
                    log.info("holding Lease %s/%s as %s", self.namespace, self.name, self.identity)
                    return
            except ApiException as error:
                log.warning("Lease %s/%s: %s", self.namespace, self.name, error.reason)
            if not logged:
                log.info("waiting for Lease %s/%s (another operator holds it)", self.namespace, self.name)
                logged = True
            await asyncio.sleep(max(1.0, self.seconds / 3))

    async def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew every third of the duration; a renewal missed for a whole duration means lost."""
        last = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.seconds / 3)
            try:
                if await asyncio.to_thread(self._try):
                    last = asyncio.get_running_loop().time()
                    continue
                reason = "another operator holds it"
            except ApiException as error:
                reason = str(error.reason)
            if asyncio.get_running_loop().time() - last >= self.seconds or reason.startswith("another"):
                self.held = False
                metrics.LEADER.set(0)
                log.error("lost Lease %s/%s: %s", self.namespace, self.name, reason)
                on_lost()
                return

    def release(self) -> None:
        """Give the Lease up at a clean exit so the next replica need not wait out the duration."""
        if not self.held:
            return
        # A renewal racing this read-modify-write makes the replace a 409: read again and retry.
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                lease = self.kube.coordination.read_namespaced_lease(self.name, self.namespace)
                if lease.spec and lease.spec.holder_identity == self.identity:
                    lease.spec.holder_identity = None
                    lease.spec.renew_time = None
                    self.kube.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
                break
            except ApiException as error:
                if error.status == 409 and attempt + 1 < RELEASE_ATTEMPTS:
                    continue
                log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, error.reason)
                break
        self.held = False
        metrics.LEADER.set(0)
