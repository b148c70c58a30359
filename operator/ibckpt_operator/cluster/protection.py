"""The PodDisruptionBudget that keeps a protected workload's pods from being evicted behind the operator's
back (docs/drains.md): `maxUnavailable: 0` over the workload's pods, owned by its CheckpointSchedule, in
`policy/v1` where the apiserver serves it and `policy/v1beta1` otherwise (v1.20). The eviction webhook
answers first; this is the backstop when the webhook is down."""

from __future__ import annotations

import logging
from typing import Any

from ibckpt.api import CheckpointJobSpec
from ibckpt_operator.cluster.kube import ApiException, Body, Kube
from ibckpt_operator.machine import PodRef

log = logging.getLogger(__name__)
# Members of a workload whose controller has no label selector of its own get this label.
PROTECTED_LABEL = "ibckpt.io/protected-by"


def pdb_name(schedule: str) -> str:
    return f"ibckpt-{schedule}"


async def pdb_api_version(kube: Kube) -> str:
    """policy/v1 when discovery lists PodDisruptionBudget there (1.21+), else policy/v1beta1."""
    if await discovered(kube, "policy/v1", "PodDisruptionBudget") is not None:
        return "policy/v1"
    return "policy/v1beta1"


_PLURALS: dict[tuple[str, str], str] = {}


async def discovered(kube: Kube, api_version: str, kind: str) -> str | None:
    """The resource name of a kind, from the apiserver's discovery; None if it is not served."""
    key = (api_version, kind)
    if key not in _PLURALS:
        found = await kube.request("GET", _api_base(api_version))
        for resource in (found or {}).get("resources", []):
            if resource.get("kind") == kind and "/" not in resource.get("name", ""):
                _PLURALS[key] = resource["name"]
    return _PLURALS.get(key)


def _api_base(api_version: str) -> str:
    return f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"


def _pdb_path(api_version: str, namespace: str, name: str | None = None) -> str:
    base = f"/apis/{api_version}/namespaces/{namespace}/poddisruptionbudgets"
    return f"{base}/{name}" if name else base


async def pod_selector(
    kube: Kube, namespace: str, schedule: str, template: CheckpointJobSpec, members: tuple[PodRef, ...]
) -> dict[str, Any]:
    """The label selector of the workload's pods: the template's own, else the workload controller's
    (StatefulSet, Job, ...), else a label the operator puts on each member (kinds with no selector)."""
    if template.selector is not None:
        return template.selector.to_wire()
    workload = template.workload_ref
    assert workload is not None
    api_version = workload.api_version or _default_api(workload.kind)
    plural = await discovered(kube, api_version, workload.kind)
    owner = None
    if plural is not None:
        path = f"{_api_base(api_version)}/namespaces/{namespace}/{plural}/{workload.name}"
        owner = await kube.request("GET", path)
    selector = ((owner or {}).get("spec") or {}).get("selector")
    if isinstance(selector, dict) and (selector.get("matchLabels") or selector.get("matchExpressions")):
        return {key: selector[key] for key in ("matchLabels", "matchExpressions") if selector.get(key)}
    for pod in members:
        patch = {"metadata": {"labels": {PROTECTED_LABEL: schedule}}}
        await kube.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{pod.name}",
            patch,
            "application/merge-patch+json",
        )
    return {"matchLabels": {PROTECTED_LABEL: schedule}}


def _default_api(kind: str) -> str:
    return {
        "StatefulSet": "apps/v1",
        "Deployment": "apps/v1",
        "ReplicaSet": "apps/v1",
        "Job": "batch/v1",
        "JobSet": "jobset.x-k8s.io/v1alpha2",
        "MPIJob": "kubeflow.org/v2beta1",
    }.get(kind, "v1")


async def ensure_pdb(kube: Kube, owner: Body, selector: dict[str, Any]) -> str:
    """Create the PDB if absent, or replace it if its selector is not this one; returns
    `<apiVersion>/<name>` for status."""
    meta = owner["metadata"]
    namespace, name = meta["namespace"], pdb_name(meta["name"])
    api_version = await pdb_api_version(kube)
    body = {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "ibckpt", "ibckpt.io/schedule": meta["name"]},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {"maxUnavailable": 0, "selector": selector},
    }
    found = await kube.request("GET", _pdb_path(api_version, namespace, name))
    if found is not None:
        spec = found.get("spec") or {}
        if spec.get("selector") == selector and spec.get("maxUnavailable") == 0:
            return f"{api_version}/{name}"
        await kube.request("DELETE", _pdb_path(api_version, namespace, name))
    try:
        await kube.request("POST", _pdb_path(api_version, namespace), body)
    except ApiException as error:
        if error.status != 409:  # a concurrent pass made it
            raise
    log.info("PodDisruptionBudget %s/%s (%s) protects %s", namespace, name, api_version, selector)
    return f"{api_version}/{name}"


async def relax_pdb(kube: Kube, namespace: str, schedule: str) -> bool:
    """Delete the PDB (absent is fine): the drain's evictions go through. False if it was absent."""
    api_version = await pdb_api_version(kube)
    return await kube.request("DELETE", _pdb_path(api_version, namespace, pdb_name(schedule))) is not None


async def get_pdb(kube: Kube, namespace: str, schedule: str) -> Body | None:
    return await kube.request("GET", _pdb_path(await pdb_api_version(kube), namespace, pdb_name(schedule)))
