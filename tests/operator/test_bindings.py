"""The restore binding of a controller's new pods (bindings.py), without a cluster: which claim answers a
pod being created, the change that binds it, and when a drain restores through the controller."""

from __future__ import annotations

from typing import Any, cast

from ibckpt_operator.cluster import bindings, schedules, selection
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.drivers.schedule import ScheduleController
from ibckpt_operator.machine.core import PodRef
from ibckpt_operator.machine.drain import DrainPhase, DrainState
from ibckpt_operator.machine.podtemplate import RESTORE_FROM, RESTORED_BY

OWNER = {
    "apiVersion": "ibckpt.io/v1alpha1",
    "kind": "CheckpointSchedule",
    "metadata": {"name": "ring", "namespace": "hpc", "uid": "u-1"},
}


class Fixed:
    """A claimant that answers one name in one namespace, or any pod of one controller."""

    def __init__(self, namespace: str, name: str, claim: bindings.Claim, controller_uid: str = "") -> None:
        self.namespace, self.name, self.answer, self.controller_uid = namespace, name, claim, controller_uid

    def claim(self, pod: bindings.NewPod) -> bindings.Claim | None:
        if self.controller_uid:
            return self.answer if pod.controller_uid == self.controller_uid else None
        return self.answer if (pod.namespace, pod.name) == (self.namespace, self.name) else None


def pod(
    name: str | None, namespace: str | None = "hpc", owner: str = "", **annotations: str
) -> dict[str, Any]:
    meta: dict[str, Any] = {"annotations": annotations}
    if name:
        meta["name"] = name
    if namespace:
        meta["namespace"] = namespace
    if owner:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "not-a-controller"},
            {"apiVersion": "batch/v1", "kind": "Job", "name": "ring", "uid": owner, "controller": True},
        ]
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


def test_a_migrating_jobs_new_pods_are_refused_by_its_controller_uid_whatever_their_name() -> None:
    waiting = Fixed("hpc", "", bindings.Waiting("ibckpt: the pods of this controller ..."), "job-uid")
    bindings.register(waiting)
    assert bindings.answer(pod(None, owner="job-uid")) == waiting.answer  # generateName, no namespace yet
    assert bindings.answer(pod(None, namespace=None, owner="job-uid")) == waiting.answer
    assert bindings.answer(pod(None, owner="other-job")) is None
    assert bindings.answer(pod("ring-0-x1")) is None  # no controller
    # the restored pods the RestoreJob creates (no owner yet: the Job adopts them) are let through
    assert bindings.answer(pod("ring-0-x1", owner="job-uid", **{RESTORED_BY: "uid-9/run"})) is None
    del waiting


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


def job_pod(uid: str, controller: tuple[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"p-{uid}", "uid": uid}
    if controller:
        kind, owner = controller
        meta["ownerReferences"] = [{"kind": kind, "name": "ring", "uid": owner, "controller": True}]
    return {"metadata": meta}


def test_a_schedule_refuses_its_sources_renaming_controllers_from_the_hold_to_the_restore() -> None:
    assert selection.controller_uid(job_pod("a", ("Job", "job-0"))) == "job-0"
    assert selection.controller_uid(job_pod("a", ("StatefulSet", "s")), bindings.NAME_KEEPING_KINDS) == ""
    assert selection.controller_uid(job_pod("a", None)) == ""

    live = {"metadata": {"name": "ring", "namespace": "hpc"}}
    controller = ScheduleController(cast(Runtime, None), live)
    sources = (PodRef("ring-0-ab", "u0", "node-1"), PodRef("ring-1-cd", "u1", "node-2"))
    controller.controllers = {"u0": "job-0", "u1": "job-1", "u9": "job-9"}  # u9: a member since
    new_pod_of = bindings.NewPod("hpc", "", "job-1")  # the Job's replacement, named by generateName
    for phase in DrainPhase:
        controller.drain = DrainState("ring", phase, sources=sources, checkpoint="ring-drain-1")
        claim = controller.claim(new_pod_of)
        if phase in (
            DrainPhase.HOLDING,
            DrainPhase.CHECKPOINTING,
            DrainPhase.COMMITTED,
            DrainPhase.RELEASING,
            DrainPhase.RESTORING,
        ):
            assert isinstance(claim, bindings.Waiting), phase
            assert "CheckpointSchedule ring" in claim.message and "controller adopts them" in claim.message
        else:  # at rest, lost or held: the controller may replace a pod
            assert claim is None, phase
        assert controller.claim(bindings.NewPod("hpc", "", "job-9")) is None  # not a source's controller
        assert controller.claim(bindings.NewPod("hpc", "other", "")) is None
