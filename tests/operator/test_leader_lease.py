"""The operator's Lease when its apiserver connection breaks, against the real apiserver through a relay the
test cuts (connections reset) or stalls (requests hang): the leader steps down before its Lease can run
out, so the second replica, which takes the Lease only once it has run out, never leads beside it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import kubernetes
import pytest

from ibckpt_operator.cluster.kube import Kube
from ibckpt_operator.cluster.leader import LeaderLease
from testbed.gate import Gate
from testbed.kube import ControlPlane

pytestmark = pytest.mark.kube
NAMESPACE = "ibckpt-system"
SECONDS = 6


@dataclass
class Relay:
    gate: Gate
    relayed: Kube  # reaches the apiserver through the gate
    direct: Kube


@pytest.fixture
def relay(kube: ControlPlane, kube_api: kubernetes.client.ApiClient) -> Iterator[Relay]:
    try:
        kubernetes.client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": NAMESPACE}})
    except kubernetes.client.ApiException as error:
        if error.status != 409:
            raise
    gate = Gate(int(kube.url.rsplit(":", 1)[1]))
    direct = kube_api.configuration
    relayed = kubernetes.client.Configuration()
    relayed.host = f"https://127.0.0.1:{gate.port}"
    relayed.ssl_ca_cert = direct.ssl_ca_cert
    relayed.api_key, relayed.api_key_prefix = dict(direct.api_key), dict(direct.api_key_prefix)
    relayed.cert_file, relayed.key_file = direct.cert_file, direct.key_file
    relayed.retries = 0
    client = kubernetes.client.ApiClient(relayed)
    try:
        yield Relay(gate, Kube(client), Kube(kube_api))
    finally:
        gate.close()
        client.close()


@pytest.mark.parametrize("fault", ["cut", "stall"])
def test_a_leader_cut_off_steps_down_before_its_lease_runs_out(relay: Relay, fault: str) -> None:
    name = f"lease-{fault}-{secrets.token_hex(3)}"
    first = LeaderLease(relay.relayed, NAMESPACE, name, "first", SECONDS)
    second = LeaderLease(relay.direct, NAMESPACE, name, "second", SECONDS)

    async def scenario() -> dict[str, float]:
        await first.acquire()
        made = relay.direct.coordination.read_namespaced_lease(name, NAMESPACE).metadata.creation_timestamp
        assert first.epoch == (int(made.timestamp()), 0), first.epoch  # the epoch the agents are sent
        lost = asyncio.Event()
        keeper = asyncio.ensure_future(first.keep(lost.set))
        await asyncio.sleep(SECONDS)  # renewed twice meanwhile
        assert not lost.is_set() and first.held
        spec = relay.direct.coordination.read_namespaced_lease(name, NAMESPACE).spec
        assert spec.holder_identity == "first"
        getattr(relay.gate, fault)()
        cut = time.time()
        taker = asyncio.ensure_future(second.acquire())
        await asyncio.wait_for(lost.wait(), timeout=3 * SECONDS)
        lost_at = time.time()
        # the last renewal that landed (one may have been in flight at the cut), before anyone took it
        last = relay.direct.coordination.read_namespaced_lease(name, NAMESPACE).spec
        assert last.holder_identity == "first", last
        await asyncio.wait_for(taker, timeout=3 * SECONDS)
        taken = time.time()
        await asyncio.wait_for(keeper, timeout=1)  # it ended: the replica stops
        relay.gate.mend()
        return {"renewed": last.renew_time.timestamp(), "cut": cut, "lost": lost_at, "taken": taken}

    times = asyncio.run(scenario())
    # Down before the Lease ran out (its last renewal plus the duration), which is the earliest the
    # second replica could take it.
    assert times["lost"] < times["renewed"] + SECONDS, times
    assert times["lost"] < times["taken"], times
    assert not first.held and second.held
    lease = relay.direct.coordination.read_namespaced_lease(name, NAMESPACE)
    assert lease.spec.holder_identity == "second" and lease.spec.lease_transitions == 1, lease.spec
    # the successor's epoch is above the deposed leader's, which keeps its own: an agent refuses that one
    assert first.epoch is not None and second.epoch == (first.epoch[0], 1), (first.epoch, second.epoch)
    assert first.epoch < second.epoch


def test_a_failed_renewal_is_retried_before_the_deadline_and_the_leader_keeps_the_lease(relay: Relay) -> None:
    """One renewal fails (the relay resets it) and the apiserver is back a moment later: the leader
    retries within its deadline instead of waiting a whole renewal period, and keeps the Lease."""
    seconds = 12  # renewals every 4 s, a retry every 2 s, stepping down after 8 s without one
    name = f"lease-retry-{secrets.token_hex(3)}"
    leader = LeaderLease(relay.relayed, NAMESPACE, name, "first", seconds)

    async def scenario() -> tuple[bool, float, float]:
        await leader.acquire()
        lost = asyncio.Event()
        keeper = asyncio.ensure_future(leader.keep(lost.set))
        relay.gate.cut()
        await asyncio.sleep(seconds / 3 + 1.0)  # the first renewal failed meanwhile
        relay.gate.mend()
        mended = time.time()
        await asyncio.sleep(2.5)  # a retry lands within RETRY_SECONDS, long before the next period
        renewed = relay.direct.coordination.read_namespaced_lease(name, NAMESPACE).spec.renew_time
        await asyncio.sleep(seconds)
        keeper.cancel()
        return lost.is_set(), mended, renewed.timestamp()

    lost, mended, renewed = asyncio.run(scenario())
    assert renewed > mended - 0.5  # renewTime has microseconds, written by the leader's clock
    assert not lost and leader.held


def test_handlers_filling_the_default_executor_never_delay_a_renewal(relay: Relay) -> None:
    """kopf runs sync handlers in the loop's default executor; busy ones must not hold the Lease's
    renewals back until the leader steps down."""
    name = f"lease-busy-{secrets.token_hex(3)}"
    leader = LeaderLease(relay.direct, NAMESPACE, name, "first", SECONDS)

    async def scenario() -> bool:
        await leader.acquire()
        lost = asyncio.Event()
        keeper = asyncio.ensure_future(leader.keep(lost.set))
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=4))
        busy = [asyncio.to_thread(time.sleep, 2 * SECONDS) for _ in range(4)]  # all its workers
        await asyncio.gather(*busy)
        keeper.cancel()
        return lost.is_set()

    assert not asyncio.run(scenario()) and leader.held
