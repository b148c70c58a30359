"""Restored pods that their own controller creates (RestoreJob `podsCreatedBy: Controller`).

A StatefulSet creates a killed pod again at once, under the same name. When that pod is part of a
restore, the operator's mutating webhook on pod creation answers for it:

- while the restore is not ready (the migration has not created its RestoreJob yet, or the images are
  still staging), the creation is **refused** with a message: the controller retries;
- once the images are staged on the pod's node, the pod is **bound**: `spec.nodeName` is that node and
  the restore annotations are added, so the node's runtime wrapper restores it from the images;
- any other pod is left alone.

A controller that names its pods anew (a Job, and so JobSets and an MPIJob's launcher) cannot be bound
by name. While a drain migrates such pods, the schedule refuses every new pod of their controller (by
its uid): the RestoreJob creates the restored pods under the sources' names and labels, without an
owner, and the controller adopts them (its selector matches), so it starts nothing of its own.

Who answers: the drivers and controllers that registered as claimants (a RestoreJob in Controller mode,
a schedule whose drain migration runs). Pure apart from that in-memory registry: no I/O.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from ibckpt_operator.machine.podtemplate import RESTORE_FROM, RESTORED_BY, controller_reference

# The controllers that create a killed pod again under its name (what binding by name needs).
NAME_KEEPING_KINDS = frozenset({"StatefulSet"})
# Set on the workload to wake its controller once the images are staged (it backs off after refusals).
RESTORING = "ibckpt.io/restoring"


@dataclass(frozen=True)
class Binding:
    """Bind the new pod to `node` and restore it from `checkpoint` (namespace/name)."""

    node: str
    checkpoint: str
    restored_by: str  # the RestoreJob's run marker (podtemplate.RESTORED_BY)


@dataclass(frozen=True)
class Waiting:
    """Refuse the pod for now; the message says what it waits for."""

    message: str


Claim = Binding | Waiting


@dataclass(frozen=True)
class NewPod:
    """A pod being created, as the claimants see it."""

    namespace: str
    name: str  # empty when its controller asked for a generated name (a Job's pods)
    controller_uid: str  # the uid of its controller ownerReference; empty without one


class Claimant(Protocol):
    def claim(self, pod: NewPod) -> Claim | None: ...


CLAIMANTS: weakref.WeakSet[Any] = weakref.WeakSet()


def register(claimant: Claimant) -> None:
    CLAIMANTS.add(claimant)


def claim_for(pod: NewPod) -> Claim | None:
    """What to do with a new pod: a staged restore's binding outranks the waits of a migration that is
    about to restore it."""
    claims = [found for claimant in list(CLAIMANTS) if (found := claimant.claim(pod))]
    return next((c for c in claims if isinstance(c, Binding)), None) or (claims[0] if claims else None)


def answer(pod: dict[str, Any]) -> Claim | None:
    """The webhook's decision for a pod being created (its body as the AdmissionReview carries it)."""
    meta = pod.get("metadata") or {}
    if RESTORED_BY in (meta.get("annotations") or {}):
        return None  # a RestoreJob's own destination pod
    controller = controller_reference(pod) or {}
    return claim_for(NewPod(meta.get("namespace") or "", meta.get("name") or "", controller.get("uid") or ""))


def merge_patch(binding: Binding) -> dict[str, Any]:
    """The change that binds a new pod: to the staged node, annotated for the runtime wrapper."""
    annotations = {RESTORE_FROM: binding.checkpoint, RESTORED_BY: binding.restored_by}
    return {"metadata": {"annotations": annotations}, "spec": {"nodeName": binding.node}}
