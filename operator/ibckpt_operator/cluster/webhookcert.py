"""The admission server's certificate, kept in a Secret of the operator's namespace (machine/webhookcert.py
says why): read at start, used as it is when it fits this replica's host, else issued again (by the same
CA while it is valid) and written back. Replicas starting together may race: the loser of a write reads
the winner's and uses it if it fits, else writes again. The release's internal CA and the coordinator's
certificate are kept the same way (cluster/internaltls.py)."""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Mapping

from ibckpt_operator.cluster.kube import ApiException, Body, Kube, is_status
from ibckpt_operator.machine import webhookcert
from ibckpt_operator.machine.webhookcert import WebhookCert

log = logging.getLogger(__name__)
ATTEMPTS = 3
MANAGED_BY = {"app.kubernetes.io/managed-by": "ibckpt-operator"}


def _decoded(secret: Body | None) -> WebhookCert | None:
    data = (secret or {}).get("data") or {}
    try:
        return webhookcert.from_data({k: base64.b64decode(v) for k, v in data.items()})
    except ValueError:
        return None


def secret_body(namespace: str, name: str, data: Mapping[str, bytes], owner: Body | None) -> Body:
    meta: Body = {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)}
    if owner is not None:  # deleted with the operator's Deployment (helm uninstall), kept across upgrades
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"]}
        ]  # fmt: skip
    encoded = {k: base64.b64encode(v).decode("ascii") for k, v in data.items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": meta,
        "data": encoded,
    }


async def ensure(
    kube: Kube, namespace: str, name: str, hosts: list[str], owner: str = "", what: str = "admission server"
) -> WebhookCert:
    """The certificate to serve for `hosts`: the Secret's if it fits, else a new one written into it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    for attempt in range(ATTEMPTS):
        now = datetime.datetime.now(datetime.UTC)
        existing = await kube.request("GET", f"{path}/{name}")
        kept = _decoded(existing)
        why = webhookcert.problem(kept, hosts, now)
        if why is None:
            assert kept is not None
            log.info("%s: certificate from Secret %s/%s", what, namespace, name)
            return kept
        cert = webhookcert.issue(hosts, now, kept)
        if not await write(kube, namespace, name, cert.data(), existing, owner, last=attempt == ATTEMPTS - 1):
            continue  # another replica wrote first: read its certificate
        same_ca = kept is not None and kept.ca_crt == cert.ca_crt
        log.info("%s: issued a certificate for %s (%s; %s CA) into Secret %s/%s",
                 what, ", ".join(hosts), why, "same" if same_ca else "new", namespace, name)  # fmt: skip
        return cert
    raise AssertionError("unreachable")  # the last attempt returned or raised


async def write(
    kube: Kube, namespace: str, name: str, data: Mapping[str, bytes], existing: Body | None, owner: str,
    last: bool,
) -> bool:  # fmt: skip
    """Create the Secret, or replace `existing` (the version read); False: another writer came first
    (only while not `last`: then the conflict is raised)."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    body = secret_body(namespace, name, data, await _deployment(kube, namespace, owner))
    try:
        if existing is None:
            await kube.request("POST", path, body)
        else:
            body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
            await kube.request("PUT", f"{path}/{name}", body)
    except ApiException as error:
        if is_status(error, 409) and not last:
            return False
        raise
    return True


async def _deployment(kube: Kube, namespace: str, name: str) -> Body | None:
    if not name:
        return None
    try:
        return await kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
    except ApiException as error:  # no owner then: the Secret outlives the release (docs/uninstall.md)
        log.warning("admission server: cannot read Deployment %s/%s: %s", namespace, name, error.reason)
        return None
