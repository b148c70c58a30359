"""One active operator at a time: a coordination.k8s.io/v1 Lease, acquired before any handler runs and
renewed while the operator lives. A replica that loses it stops (its jobs' state is in their status; the
next leader resumes them)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import kubernetes
from kubernetes.client import ApiException

from ibckpt.agentapi import LeaderEpoch
from ibckpt_operator import metrics
from ibckpt_operator.cluster.kube import Kube

log = logging.getLogger(__name__)
RELEASE_ATTEMPTS = 5
# A leader that has not renewed for this part of the lease duration steps down (see keep()).
STEP_DOWN = 2 / 3
# Between failed renewals, as client-go's retryPeriod: a slow answer is retried, not waited out.
RETRY_SECONDS = 2.0


def _why(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"


def _created(lease: kubernetes.client.V1Lease) -> int:
    """The Lease's creation in unix seconds: the first half of the leader epoch."""
    created = lease.metadata.creation_timestamp if lease.metadata is not None else None
    return int(created.timestamp()) if created is not None else 0


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
        # (the Lease's creation, its leaseTransitions when this replica took it): the leader epoch sent
        # to the agents with every call (agentapi.LEADER_EPOCH_HEADER); each new holder's is higher.
        self.epoch: LeaderEpoch | None = None
        # What the last attempt saw, for the readiness endpoint of a replica that waits (a standby).
        self.holder: str | None = None
        self.answered_at: float | None = None  # time.monotonic() of the apiserver's last answer
        # The Lease's own thread: handlers busy in the default executor never delay a renewal.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")

    def _spec(self, transitions: int, acquired: datetime) -> kubernetes.client.V1LeaseSpec:
        return kubernetes.client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self.seconds,
            acquire_time=acquired,
            renew_time=_now(),
            lease_transitions=transitions,
        )

    def _try(self, timeout: float | None = None) -> bool:
        """One attempt to take or renew the Lease, each call bounded by `timeout`; the apiserver's
        resourceVersion check settles races."""
        api = self.kube.coordination
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as error:
            if error.status != 404:
                raise
            self.answered_at, self.holder = time.monotonic(), None
            body = kubernetes.client.V1Lease(
                metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(0, _now()),
            )
            try:
                made = api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
                self.epoch = (_created(made), 0)
                return True
            except ApiException as create_error:
                if create_error.status == 409:
                    return False
                raise
        spec = lease.spec or kubernetes.client.V1LeaseSpec()
        self.answered_at, self.holder = time.monotonic(), spec.holder_identity
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
            api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=timeout
            )  # 409: it moved
            self.epoch = (_created(lease), transitions)
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
                if await self._attempt(self.seconds):
                    self.held = True
                    metrics.LEADER.set(1)
                    log.info("holding Lease %s/%s as %s", self.namespace, self.name, self.identity)
                    return
            except Exception as error:  # an unreachable apiserver: try again
                log.warning("Lease %s/%s: %s", self.namespace, self.name, _why(error))
            if not logged:
                log.info("waiting for Lease %s/%s (another operator holds it)", self.namespace, self.name)
                logged = True
            await asyncio.sleep(max(1.0, self.seconds / 3))

    def standby_state(self) -> tuple[bool, str]:
        """(able to take over, why) for a replica waiting for the Lease: it is, while the apiserver
        answered its last attempts."""
        if self.answered_at is None:
            return False, f"waiting for Lease {self.namespace}/{self.name}: no answer from the apiserver yet"
        silent = time.monotonic() - self.answered_at
        if silent > 3 * self.seconds:
            return False, f"standby: the apiserver has not answered for {silent:.0f} s"
        return True, f"standby: {self.holder or 'nobody'} holds Lease {self.namespace}/{self.name}"

    async def _attempt(self, timeout: float | None) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._try, timeout)

    async def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew every third of the duration, and retry a failed or slow renewal every RETRY_SECONDS.
        Whatever goes wrong (errors, calls that hang, another holder), a replica that has not renewed
        for STEP_DOWN of the duration steps down: it has stopped before anyone else may take the Lease,
        which needs the whole duration to pass."""
        loop = asyncio.get_running_loop()
        limit = self.seconds * STEP_DOWN
        last = loop.time()
        wait = self.seconds / 3
        while True:
            await asyncio.sleep(wait)
            started, left = loop.time(), last + limit - loop.time()
            try:
                if await asyncio.wait_for(self._attempt(max(0.5, left)), timeout=max(0.1, left)):
                    last, wait = started, self.seconds / 3  # the renewTime written is no earlier
                    continue
                reason = "another operator holds it"
            except TimeoutError:
                reason = f"the apiserver did not answer within {max(0.1, left):.1f} s"
            except Exception as error:
                reason = _why(error)
            if reason.startswith("another") or loop.time() - last >= limit:
                self.held = False
                metrics.LEADER.set(0)
                log.error("lost Lease %s/%s: %s", self.namespace, self.name, reason)
                on_lost()
                return
            log.warning("Lease %s/%s not renewed: %s", self.namespace, self.name, reason)
            wait = min(RETRY_SECONDS, max(0.0, last + limit - loop.time()))

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
