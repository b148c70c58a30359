"""Let the node agents read a location's Secrets in its namespace, by name (machine/secretgrants.py says
why): the Role there gains the names, the RoleBinding is made once. Names are added, never removed here:
a running job of another storage in the namespace may still need its own."""

from __future__ import annotations

import logging
from typing import Any

from ibckpt.api import S3Location
from ibckpt_operator.cluster.kube import ApiException, Kube, api_message, is_status
from ibckpt_operator.cluster.storage import StorageProblem
from ibckpt_operator.config import current
from ibckpt_operator.machine import secretgrants

ATTEMPTS = 3  # a concurrent job in the namespace may write the Role between our read and write

log = logging.getLogger(__name__)


async def _owner(kube: Kube, cluster_role: str) -> dict[str, Any] | None:
    """The grants' owner (machine/secretgrants.py): the named ClusterRole, or None when it is not there
    (the grants are then only removed by `kubectl ibckpt uninstall`)."""
    if not cluster_role:
        return None
    try:
        found = await kube.request("GET", f"/apis/{secretgrants.RBAC}/v1/clusterroles/{cluster_role}")
    except ApiException as error:
        log.warning(
            "cannot read ClusterRole %s to own the storage grants: %s", cluster_role, api_message(error)
        )
        return None
    if found is None:
        log.warning("ClusterRole %s is missing: the storage grants will have no owner", cluster_role)
        return None
    return secretgrants.owner_reference(cluster_role, found["metadata"]["uid"])


async def grant(kube: Kube, namespace: str, location: S3Location) -> None:
    """Make sure the agents may `get` this location's Secrets in `namespace`. Without an agent account
    configured (`--agent-account`), nothing is granted: the agents' own RBAC decides (a fixed name).
    Refused by the apiserver: StorageProblem SecretsNotGranted (the step fails before any rank is cut)."""
    settings = current()
    if not settings.agent_account:
        return
    name, release = secretgrants.grant_name(settings.agent_account), settings.release
    wanted = set(secretgrants.agent_secrets(location))
    owner = await _owner(kube, settings.grants_owner)
    base = f"/apis/{secretgrants.RBAC}/v1/namespaces/{namespace}"
    for attempt in range(ATTEMPTS):
        try:
            existing = await kube.request("GET", f"{base}/roles/{name}")
            if existing is None:
                body = secretgrants.role(namespace, name, wanted, release, owner)
                await kube.request("POST", f"{base}/roles", body)
            elif not wanted <= secretgrants.granted(existing) or secretgrants.relabel(
                existing, release, owner
            ):
                body = secretgrants.role(
                    namespace, name, wanted | secretgrants.granted(existing), release, owner
                )
                body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                await kube.request("PUT", f"{base}/roles/{name}", body)
            bound = await kube.request("GET", f"{base}/rolebindings/{name}")
            if bound is None or secretgrants.relabel(bound, release, owner):
                body = secretgrants.binding(
                    namespace, name, settings.agent_account, settings.namespace, release, owner
                )
                if bound is None:
                    await kube.request("POST", f"{base}/rolebindings", body)
                else:
                    body["metadata"]["resourceVersion"] = bound["metadata"]["resourceVersion"]
                    await kube.request("PUT", f"{base}/rolebindings/{name}", body)
            return
        except ApiException as error:
            if not is_status(error, 409) or attempt == ATTEMPTS - 1:
                message = f"cannot let the node agents read Secrets {sorted(wanted)}: {api_message(error)}"
                raise StorageProblem("SecretsNotGranted", message) from None
