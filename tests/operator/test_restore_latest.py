"""Restore "the latest": which Checkpoint a RestoreJob's latestOf chooses (pure). The whole path, on the
real apiserver and S3, is in test_restore_handlers.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ibckpt.api import Checkpoint, LatestCheckpoint, RestoreJobSpec, WorkloadReference
from ibckpt.api.schedule import SCHEDULE_LABEL
from ibckpt_operator.machine.latest import choose_latest

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def made(name: str, minutes: int, *, schedule: str | None = "nightly", ready: bool | None = True,
         job: str = "ns/ring", template: bool = True, source: str | None = None) -> Checkpoint:  # fmt: skip
    pod = {"name": "ring-0", "node": "node-a", "ranks": ["ring/ring-0/main/1"]}
    if template:
        pod["template"] = {"spec": {"containers": [{"name": "main", "image": "ring:test"}]}}
    labels = {SCHEDULE_LABEL: schedule} if schedule else {}
    when = (NOW + timedelta(minutes=minutes)).isoformat()
    body: dict = {
        "metadata": {"name": name, "labels": labels, "creationTimestamp": when},
        "spec": {"manifestKey": "k", "storageRef": {"name": "store"}, "jobName": job, "checkpointId": name,
                 "pods": [pod]},
    }  # fmt: skip
    if source:
        body["spec"]["source"] = {"apiVersion": "batch/v1", "kind": "Job", "name": source}
    if ready is not None:
        body["status"] = {"readyToRestore": ready, "message": None if ready else "its manifest is gone"}
    return Checkpoint.from_wire(body)


def test_the_newest_restorable_of_the_group_is_chosen_and_each_newer_one_says_why_not() -> None:
    group = [
        made("c1", 1),
        made("c2", 2),
        made("c3", 3, template=False),
        made("c4", 4, ready=False),
        made("c5", 5, job="other-team/ring"),
        made("c6", 6, schedule="hourly"),  # newer, but another schedule's
        made("c7", 7, schedule=None),
    ]
    choice = choose_latest(group, "ns", LatestCheckpoint(schedule="nightly"))
    assert choice.name == "c2" and choice.considered == 5
    assert [name for name, _ in choice.skipped] == ["c5", "c4", "c3"]
    why = dict(choice.skipped)
    assert why["c5"].startswith("ForeignCheckpoint") and "other-team/ring" in why["c5"]
    assert why["c4"] == "it is not ready to restore: its manifest is gone"
    assert why["c3"].startswith("CheckpointNotRestorable") and "no pod template for ring-0" in why["c3"]
    # a Checkpoint whose readiness was not written yet is a candidate
    assert choose_latest([made("c8", 8, ready=None)], "ns", LatestCheckpoint(schedule="nightly")).name == "c8"


def test_a_workload_group_matches_its_source_and_an_empty_group_chooses_nothing() -> None:
    group = [made("a1", 1, source="train"), made("a2", 2, source="train"), made("b1", 3, source="eval")]
    train = LatestCheckpoint(workload=WorkloadReference(api_version="batch/v1", kind="Job", name="train"))
    assert choose_latest(group, "ns", train).name == "a2"
    any_group = LatestCheckpoint(workload=WorkloadReference(kind="Job", name="eval"))
    assert choose_latest(group, "ns", any_group).name == "b1"
    other_api = LatestCheckpoint(
        workload=WorkloadReference(api_version="kubeflow.org/v1", kind="Job", name="eval")
    )
    none = choose_latest(group, "ns", other_api)
    assert (none.name, none.skipped, none.considered) == (None, [], 0)


def test_a_spec_names_a_checkpoint_or_a_group_exactly() -> None:
    with pytest.raises(ValueError, match="checkpointName or latestOf"):
        RestoreJobSpec.from_wire({})
    with pytest.raises(ValueError, match="exactly one of schedule and workload"):
        RestoreJobSpec.from_wire({"latestOf": {}})
    with pytest.raises(ValueError, match="exactly one of schedule and workload"):
        RestoreJobSpec.from_wire({"latestOf": {"schedule": "a", "workload": {"kind": "Job", "name": "b"}}})
