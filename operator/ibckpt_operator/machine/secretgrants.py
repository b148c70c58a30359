"""Which Secrets the node agents may read, per namespace: the objects that grant it (pure).

The agents read a storage's Secrets themselves, so credentials never cross the node network in a
request. What they may read is granted by name in the storage's own namespace: one Role there allows
`get` on exactly the Secrets that its CheckpointStorages (or jobs' inline locations) named for a
checkpoint or a restore, and one RoleBinding gives it to the agents' account. A tenant can make the
agents read only Secrets of its own namespace: the operator always reads and grants in the job's.

Both are owned by the agents' ClusterRole when the operator knows it (`--grants-owner`): Helm does not
know these objects, but `helm uninstall` deletes that ClusterRole, and Kubernetes' garbage collector
then deletes every namespace's grants with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ibckpt.api import S3Location

RBAC = "rbac.authorization.k8s.io"
MANAGED_BY = {"app.kubernetes.io/managed-by": "ibckpt-operator"}
RELEASE_LABEL = "app.kubernetes.io/instance"  # the Helm release, as the chart's own objects carry it


def labels(release: str) -> dict[str, str]:
    """What the Role and RoleBinding carry: `kubectl ibckpt uninstall` finds them by these across
    namespaces (Helm does not know them)."""
    return {**MANAGED_BY, RELEASE_LABEL: release} if release else dict(MANAGED_BY)


def grant_name(agent_account: str) -> str:
    """The Role and RoleBinding's name in each namespace: the agents' account's, so releases differ."""
    return f"{agent_account}-storage"


def agent_secrets(location: S3Location) -> list[str]:
    """The Secrets an agent reads for this location: its credentials, its endpoint's CA bundle and its
    client-side encryption key."""
    names = {location.credentials_secret_ref.name}
    if location.ca_bundle_secret_ref is not None:
        names.add(location.ca_bundle_secret_ref.name)
    if location.encryption is not None and location.encryption.key_secret_ref is not None:
        names.add(location.encryption.key_secret_ref.name)
    return sorted(names)


def owner_reference(cluster_role: str, uid: str) -> dict[str, Any]:
    """The grants' owner: a cluster-scoped object may own namespaced ones. Deleting it never waits
    for them (no blockOwnerDeletion), so the operator needs no rights on it beyond reading its uid."""
    return {"apiVersion": f"{RBAC}/v1", "kind": "ClusterRole", "name": cluster_role, "uid": uid}


def relabel(existing: dict[str, Any] | None, release: str, owner: dict[str, Any] | None = None) -> bool:
    """An object made before its labels were what `labels(release)` says, or before it had its owner
    (an older operator)."""
    meta = (existing or {}).get("metadata") or {}
    have = meta.get("labels") or {}
    if any(have.get(key) != value for key, value in labels(release).items()):
        return True
    return owner is not None and not any(
        ref.get("uid") == owner["uid"] for ref in meta.get("ownerReferences") or ()
    )


def _metadata(namespace: str, name: str, release: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels(release)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def granted(role: dict[str, Any] | None) -> set[str]:
    """The Secret names an existing Role of ours grants."""
    names: set[str] = set()
    for rule in (role or {}).get("rules") or ():
        if "secrets" in (rule.get("resources") or ()):
            names.update(rule.get("resourceNames") or ())
    return names


def role(
    namespace: str, name: str, secrets: Iterable[str], release: str = "", owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "Role",
        "metadata": _metadata(namespace, name, release, owner),
        "rules": [
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": sorted(secrets), "verbs": ["get"]}
        ],
    }


def binding(
    namespace: str,
    name: str,
    account: str,
    account_namespace: str,
    release: str = "",
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(namespace, name, release, owner),
        "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": account_namespace}],
    }
