"""The restore binding of a controller's new pods (bindings.py), without a cluster: which claim answers a
pod being created, the change that binds it, and when a drain restores through the controller."""

from __future__ import annotations

from typing import Any

from ibckpt_operator import bindings, schedules
from ibckpt_operator.podtemplate import RESTORE_FROM, RESTORED_BY

OWNER = {
    "apiVersion": "ibckpt.io/v1alpha1",
    "kind": "CheckpointSchedule",
    "metadata": {"name": "ring", "namespace": "hpc", "uid": "u-1"},
}


class Fixed:
    """A claimant that answers one name in one namespace."""

    def __init__(self, namespace: str, name: str, claim: bindings.Claim) -> None:
        self.namespace, self.name, self.answer = namespace, name, claim

    def claim(self, namespace: str, name: str) -> bindings.Claim | None:
        return self.answer if (namespace, name) == (self.namespace, self.name) else None


def pod(name: str | None, namespace: str | None = "hpc", **annotations: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"annotations": annotations}
    if name:
        meta["name"] = name
    if namespace:
        meta["namespace"] = namespace
    return {"metadata": meta, "spec": {"containers": [{"name": "main"}]}}


def test_a_staged_restore_binds_and_outranks_the_migration_that_waits_for_it() -> None:
    waiting = Fixed("hpc", "ring-0", bindings.Waiting("ibckpt: pod ring-0 is being migrated"))
    binding = Fixed("hpc", "ring-0", bindings.Binding("node-2", "hpc/ring-drain-1", "uid-9/run"))
    bindings.register(waiting)
    assert bindings.answer(pod("ring-0")) == waiting.answer  # the migration alone: refused for now
    bindings.register(binding)
    assert bindings.answer(pod("ring-0")) == binding.answer
    assert bindings.answer(pod("ring-1")) is None  # not a claimed name
    assert bindings.answer(pod("ring-0", namespace="other")) is None  # the same name elsewhere
    assert bindings.answer(pod(None)) is None  # generateName: no controller that keeps names
    # a RestoreJob's own destination pod is never touched
    assert bindings.answer(pod("ring-0", **{RESTORED_BY: "uid-9/run"})) is None
    del waiting, binding  # the registry holds claimants weakly: a finished driver drops out
    assert bindings.answer(pod("ring-0")) is None


def test_the_binding_pins_the_node_and_adds_the_restore_annotations() -> None:
    patch = bindings.merge_patch(bindings.Binding("node-2", "hpc/ring-drain-1", "uid-9/run"))
    assert patch == {
        "metadata": {"annotations": {RESTORE_FROM: "hpc/ring-drain-1", RESTORED_BY: "uid-9/run"}},
        "spec": {"nodeName": "node-2"},
    }


def checkpoint(*kinds: str | None) -> dict[str, Any]:
    pods = [
        {"name": f"ring-{i}", "template": {"controller": {"kind": kind, "name": "ring"} if kind else None}}
        for i, kind in enumerate(kinds)
    ]
    return {"spec": {"pods": pods}}


def test_a_drain_restores_through_the_controller_only_when_every_pod_keeps_its_name() -> None:
    assert schedules.restored_by_controller(checkpoint("StatefulSet", "StatefulSet"))
    assert not schedules.restored_by_controller(checkpoint("StatefulSet", None))  # a bare pod among them
    assert not schedules.restored_by_controller(checkpoint("Job"))  # a Job names its new pods anew
    assert not schedules.restored_by_controller(checkpoint())
    assert not schedules.restored_by_controller(None)
    body = schedules.restore_job_body(
        OWNER, "ring-restore-1", "ring-drain-1", ("node-1",), by_controller=True
    )
    assert body["spec"]["podsCreatedBy"] == "Controller"
    assert "podsCreatedBy" not in schedules.restore_job_body(OWNER, "r", "c", ())["spec"]
