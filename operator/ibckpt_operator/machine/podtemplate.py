"""A checkpointed pod's template, and the destination pod a restore creates from it. Pure: pod bodies
as the apiserver's JSON (dicts) in, dicts out; no client, no I/O.

The template keeps what makes the pod the same pod (name, labels, annotations, hostname, subdomain,
containers, volumes, runtime class, security context, service account, scheduling constraints) and
drops what the apiserver, the scheduler or an admission controller sets for one incarnation (node,
status, uid, owners, the service-account token volume). Secrets stay references: nothing is resolved.
"""

from __future__ import annotations

import copy
from typing import Any

from ibckpt.api import PodTemplate, WorkloadReference
from ibckpt_operator.machine.restoreplan import placement_selector

RESTORE_FROM = "ibckpt.io/restore-from"  # the runtime wrapper restores a container of a pod with this
RESTORED_BY = "ibckpt.io/restored-by"  # RestoreJob uid/run: the pods a restore created, found by name
RUNTIME_CLASS = "ibckpt"  # the chart's RuntimeClass: its handler is the wrapper that restores
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"

# Spec fields a new incarnation must not carry: set by the scheduler (nodeName), or by admission
# from other fields (priority from priorityClassName, overhead from the RuntimeClass), or per run.
_DROPPED_SPEC = ("nodeName", "priority", "preemptionPolicy", "overhead", "ephemeralContainers")
_DROPPED_SPEC_ALIAS = "serviceAccount"  # deprecated alias of serviceAccountName, filled by the apiserver


def _token_volumes(spec: dict[str, Any]) -> set[str]:
    """The volumes the ServiceAccount admission controller added: mounted at the token path, and a
    projected service-account token (1.21+) or the account's `<sa>-token-*` Secret (before)."""
    account = spec.get("serviceAccountName") or spec.get(_DROPPED_SPEC_ALIAS) or "default"
    mounted = {
        mount.get("name")
        for container in [*(spec.get("containers") or ()), *(spec.get("initContainers") or ())]
        for mount in container.get("volumeMounts") or ()
        if mount.get("mountPath") == SERVICE_ACCOUNT_MOUNT
    }
    found = set()
    for volume in spec.get("volumes") or ():
        if volume.get("name") not in mounted:
            continue
        sources = (volume.get("projected") or {}).get("sources") or ()
        secret = (volume.get("secret") or {}).get("secretName") or ""
        if any("serviceAccountToken" in source for source in sources) or secret.startswith(
            f"{account}-token-"
        ):
            found.add(volume["name"])
    return found


def controller_reference(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's ownerReference that is its controller, if any."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return next((owner for owner in owners if owner.get("controller")), None)


def controller_of(pod: dict[str, Any]) -> WorkloadReference | None:
    owner = controller_reference(pod)
    if owner is None:
        return None
    return WorkloadReference(api_version=owner.get("apiVersion"), kind=owner["kind"], name=owner["name"])


def sanitize(pod: dict[str, Any]) -> PodTemplate:
    """The template of a live pod (its body as the apiserver returns it)."""
    meta = pod.get("metadata", {})
    spec = copy.deepcopy(pod.get("spec") or {})
    tokens = _token_volumes(spec)
    for name in (*_DROPPED_SPEC, _DROPPED_SPEC_ALIAS):
        spec.pop(name, None)
    if tokens:
        spec["volumes"] = [v for v in spec.get("volumes") or () if v.get("name") not in tokens]
        if not spec["volumes"]:
            del spec["volumes"]
        for container in [*(spec.get("containers") or ()), *(spec.get("initContainers") or ())]:
            mounts = [m for m in container.get("volumeMounts") or () if m.get("name") not in tokens]
            if mounts:
                container["volumeMounts"] = mounts
            else:
                container.pop("volumeMounts", None)
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k not in (RESTORE_FROM, RESTORED_BY)
    }
    return PodTemplate(
        labels=dict(meta.get("labels") or {}) or None,
        annotations=annotations or None,
        controller=controller_of(pod),
        spec=spec,
    )


def destination_pod(
    template: PodTemplate,
    *,
    name: str,
    namespace: str,
    node: str,
    checkpoint: str,
    restored_by: str,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """The pod a restore creates: the same name, hostname and subdomain, bound to `node` (no scheduler),
    in the ibckpt RuntimeClass, annotated with the checkpoint it restores from (`NAMESPACE/NAME`).
    `owner` (an ownerReference) only when the source had no controller: see docs/operator.md."""
    spec = copy.deepcopy(template.spec)
    spec["nodeName"] = node
    if spec.get("nodeSelector"):  # a pin to the source's hostname would make the kubelet refuse the pod
        spec["nodeSelector"] = placement_selector(spec["nodeSelector"])
        if not spec["nodeSelector"]:
            del spec["nodeSelector"]
    spec["runtimeClassName"] = RUNTIME_CLASS
    annotations = {**(template.annotations or {}), RESTORE_FROM: checkpoint, RESTORED_BY: restored_by}
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": annotations}
    if template.labels:
        metadata["labels"] = dict(template.labels)
    if owner is not None and template.controller is None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def scratch_pod(template: PodTemplate, *, name: str, namespace: str) -> dict[str, Any]:
    """A bare pod created again from scratch by a recovery: its own name, labels, annotations and spec,
    left to the scheduler (no node; no pin to the failed node's hostname), starting from the beginning."""
    spec = copy.deepcopy(template.spec)
    if spec.get("nodeSelector"):
        spec["nodeSelector"] = placement_selector(spec["nodeSelector"])
        if not spec["nodeSelector"]:
            del spec["nodeSelector"]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if template.labels:
        metadata["labels"] = dict(template.labels)
    if template.annotations:
        metadata["annotations"] = dict(template.annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
