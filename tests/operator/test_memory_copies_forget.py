"""drivers/memorycopies.forget_replaced: once a Checkpoint's copies are sealed, the same job's older
Checkpoints stop listing the copies they replaced on their holders; a newer one never does. The watch of
an older Checkpoint can end after a newer one's (each asks the holders until both parts are sealed), and
stripped the newer one's copies: CI-like runs of 2026-12-05 saw the newest periodic checkpoint of
tests/helm/test_recovery.py list one part's copy of two. The apiserver here is a stand-in that keeps the
bodies and the status patches, since only the choice of Checkpoints is under test."""

from __future__ import annotations

from typing import Any

from ibckpt.api import MemoryCopy
from ibckpt_operator.drivers.memorycopies import forget_replaced

COPIES = [{"part": "node-1", "node": "node-2", "chunks": 1, "bytes": 10},
          {"part": "node-2", "node": "node-1", "chunks": 1, "bytes": 10}]  # fmt: skip


def body(name: str, made: str) -> dict[str, Any]:
    return {
        "apiVersion": "ibckpt.io/v1alpha1", "kind": "Checkpoint",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": made},
        "spec": {"manifestKey": "m.json", "jobName": "ns/ring", "checkpointId": name, "mode": "LeaveRunning",
                 "storage": {"bucket": "ring-bucket", "credentialsSecretRef": {"name": "s3"}}, "pods": [],
                 "nodes": ["node-1", "node-2"]},
        "status": {"memoryCopies": COPIES, "tiers": ["S3", "Memory"]},
    }  # fmt: skip


class Kube:
    def __init__(self, *bodies: dict[str, Any]) -> None:
        self.bodies = list(bodies)
        self.patched: dict[str, dict[str, Any]] = {}

    async def list_custom(self, plural: str) -> list[dict[str, Any]]:
        return self.bodies

    async def patch_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patched[name] = status


class Runtime:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube


async def test_only_older_checkpoints_stop_listing_the_copies_a_newer_one_replaced() -> None:
    kube = Kube(body("ring-1", "2026-12-05T20:00:00Z"), body("ring-2", "2026-12-05T20:01:00Z"))
    sealed = [MemoryCopy.model_validate(c) for c in COPIES]
    rt: Any = Runtime(kube)
    await forget_replaced(rt, "ns", "ns/ring", "ring-1", sealed)  # an older one's watch, ending late
    assert kube.patched == {}, kube.patched
    await forget_replaced(rt, "ns", "ns/ring", "ring-2", sealed)
    assert set(kube.patched) == {"ring-1"}
    assert kube.patched["ring-1"]["memoryCopies"] is None and kube.patched["ring-1"]["tiers"] == ["S3"]
