"""Host tests of the RDMA devices a manifest records per checkpointed container (RankInfo.devices):
they survive a signed round trip, a manifest without them reads as before, and a restore's plan takes
its container's."""

from __future__ import annotations

import json
from typing import Any

from store.conftest import sample_manifest

from ibckpt.agentapi import models as api
from ibckpt.store.manifest import ContainerDevices, RankInfo, parse_manifest
from ibckpt.store.signing import ManifestKeys
from ibckpt_node.agent import restoring

KEYS = ManifestKeys({"test-key": bytes(range(32))})
KEY = "ring/ring-0/main/7"
DEVICES = ContainerDevices(allocated=["mlx5_2", "mlx5_0"], used={KEY: ["mlx5_0", "mlx5_2"]})


def ranks() -> list[RankInfo]:
    return [
        RankInfo(rank=0, pod="ring-0", node="node-1", root="node-1/ring-0.main", devices=DEVICES),
        RankInfo(rank=1, pod="ring-1", node="node-1", root="node-1/ring-1.main"),  # recorded none
    ]


def test_devices_survive_a_signed_round_trip() -> None:
    signed = sample_manifest(ranks=ranks()).signed(KEYS, "lab/ns/solver/c1/manifest.json")
    back = parse_manifest(signed.to_json(), "m", keys=KEYS, object_key="lab/ns/solver/c1/manifest.json")
    assert back.ranks[0].devices == DEVICES
    assert back.ranks[0].devices.used[KEY] == ["mlx5_0", "mlx5_2"]  # context order kept
    assert back.ranks[1].devices is None


def test_a_container_without_devices_writes_no_key_so_older_readers_read_it() -> None:
    raw: dict[str, Any] = json.loads(sample_manifest(ranks=ranks()).to_json())
    assert "devices" in raw["ranks"][0] and "devices" not in raw["ranks"][1]
    assert raw["ranks"][0]["devices"]["allocated"] == ["mlx5_2", "mlx5_0"]


def test_a_manifest_from_before_devices_reads_with_none() -> None:
    raw: dict[str, Any] = json.loads(sample_manifest().to_json())
    raw["ranks"] = [{"rank": 0, "pod": "ring-0", "node": "node-1", "root": "node-1/ring-0.main"}]
    assert parse_manifest(json.dumps(raw).encode(), "old").ranks[0].devices is None


def test_a_restore_plans_each_container_with_its_recorded_devices() -> None:
    manifest = sample_manifest(ranks=ranks())
    request = api.RestoreRequest.model_validate(
        {
            "sessionId": "s1", "job": "ring", "checkpoint": "team/c1", "epoch": 2,
            "images": {
                "location": {"endpoint": "http://s3", "bucket": "bkt", "credentialsSecretRef": {"name": "s"}},
                "credentials": {"namespace": "ibckpt", "name": "s"}, "job": "ring", "checkpointId": "c1",
            },
            "coordinator": "10.0.0.1:7000", "sessionToken": "t",
            "ranks": [
                {"rankKey": KEY, "namespace": "team", "pod": "ring-0", "container": "main", "podUid": ""},
                {"rankKey": "ring/ring-1/main/9", "namespace": "team", "pod": "ring-1", "container": "main",
                 "podUid": ""},
            ],
        }
    )  # fmt: skip
    planned = {item.pod: item for item in restoring.plan(request, manifest)}
    assert planned["ring-0"].devices == DEVICES
    assert planned["ring-1"].devices is None
    recorded = restoring.recorded_devices(list(planned.values()), {KEY: "uid-new"})
    assert [(r.pod_uid, r.allocated, dict(r.used)) for r in recorded] == [
        ("uid-new", ("mlx5_2", "mlx5_0"), {KEY: ["mlx5_0", "mlx5_2"]})
    ]
