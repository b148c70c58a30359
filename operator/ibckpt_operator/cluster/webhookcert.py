"""The admission server's certificate, kept in a Secret of the operator's namespace (machine/webhookcert.py
says why): read at start, used as it is when it fits this replica's host, else issued again (by the same
CA while it is valid) and written back. Replicas starting together may race: the loser of a write reads
the winner's and uses it if it fits, else writes again."""

from __future__ import annotations

import base64
import datetime
import logging

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


def secret_body(namespace: str, name: str, cert: WebhookCert, owner: Body | None) -> Body:
    meta: Body = {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)}
    if owner is not None:  # deleted with the operator's Deployment (helm uninstall), kept across upgrades
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"]}
        ]  # fmt: skip
    data = {k: base64.b64encode(v).decode("ascii") for k, v in cert.data().items()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": meta, "data": data}


async def ensure(kube: Kube, namespace: str, name: str, hosts: list[str], owner: str = "") -> WebhookCert:
    """The certificate to serve for `hosts`: the Secret's if it fits, else a new one written into it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    for attempt in range(ATTEMPTS):
        now = datetime.datetime.now(datetime.UTC)
        existing = await kube.request("GET", f"{path}/{name}")
        kept = _decoded(existing)
        why = webhookcert.problem(kept, hosts, now)
        if why is None:
            assert kept is not None
            log.info("admission server: certificate from Secret %s/%s", namespace, name)
            return kept
        cert = webhookcert.issue(hosts, now, kept)
        deployment = await _deployment(kube, namespace, owner)
        body = secret_body(namespace, name, cert, deployment)
        try:
            if existing is None:
                await kube.request("POST", path, body)
            else:
                body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                await kube.request("PUT", f"{path}/{name}", body)
        except ApiException as error:
            if is_status(error, 409) and attempt < ATTEMPTS - 1:
                continue  # another replica wrote first: read its certificate
            raise
        same_ca = kept is not None and kept.ca_crt == cert.ca_crt
        log.info("admission server: issued a certificate for %s (%s; %s CA) into Secret %s/%s",
                 ", ".join(hosts), why, "same" if same_ca else "new", namespace, name)  # fmt: skip
        return cert
    raise AssertionError("unreachable")  # the last attempt returned or raised


async def _deployment(kube: Kube, namespace: str, name: str) -> Body | None:
    if not name:
        return None
    try:
        return await kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
    except ApiException as error:  # no owner then: the Secret outlives the release (docs/uninstall.md)
        log.warning("admission server: cannot read Deployment %s/%s: %s", namespace, name, error.reason)
        return None
