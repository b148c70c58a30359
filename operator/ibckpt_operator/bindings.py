"""Restored pods that their own controller creates (RestoreJob `podsCreatedBy: Controller`).

A StatefulSet creates a killed pod again at once, under the same name. When that pod is part of a
restore, the operator's mutating webhook on pod creation answers for it:

- while the restore is not ready (the migration has not created its RestoreJob yet, or the images are
  still staging), the creation is **refused** with a message: the controller retries;
- once the images are staged on the pod's node, the pod is **bound**: `spec.nodeName` is that node and
  the restore annotations are added, so the node's runtime wrapper restores it from the images;
- any other pod is left alone.

Who answers: the drivers and controllers that registered as claimants (a RestoreJob in Controller mode,
a schedule whose drain migration runs). Pure apart from that in-memory registry: no I/O.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from ibckpt_operator.podtemplate import RESTORE_FROM, RESTORED_BY

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


class Claimant(Protocol):
    def claim(self, namespace: str, name: str) -> Claim | None: ...


CLAIMANTS: weakref.WeakSet[Any] = weakref.WeakSet()


def register(claimant: Claimant) -> None:
    CLAIMANTS.add(claimant)


def claim_for(namespace: str, name: str) -> Claim | None:
    """What to do with a new pod of this name: a staged restore's binding outranks the waits of a
    migration that is about to restore it."""
    claims = [found for claimant in list(CLAIMANTS) if (found := claimant.claim(namespace, name))]
    return next((c for c in claims if isinstance(c, Binding)), None) or (claims[0] if claims else None)


def answer(pod: dict[str, Any]) -> Claim | None:
    """The webhook's decision for a pod being created (its body as the AdmissionReview carries it)."""
    meta = pod.get("metadata") or {}
    if RESTORED_BY in (meta.get("annotations") or {}):
        return None  # a RestoreJob's own destination pod
    name, namespace = meta.get("name"), meta.get("namespace")
    if not name or not namespace:
        return None  # generateName: not a pod a name-keeping controller makes
    return claim_for(namespace, name)


def merge_patch(binding: Binding) -> dict[str, Any]:
    """The change that binds a new pod: to the staged node, annotated for the runtime wrapper."""
    annotations = {RESTORE_FROM: binding.checkpoint, RESTORED_BY: binding.restored_by}
    return {"metadata": {"annotations": annotations}, "spec": {"nodeName": binding.node}}
