"""The release's own TLS kept in two Secrets of the operator's namespace (machine/internaltls.py says
what each holds): the operator's CA with the coordinator's certificate, and the agents' serving
certificate that their DaemonSet mounts. The leader makes them at start (the agents' pods wait,
Pending, until their Secret exists) and looks again every RECHECK_S, so a certificate is renewed long
before it expires; the agents serve a renewed one without a restart (ibckpt_node.agent.servingcert)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
from collections.abc import Callable

from ibckpt.tls import COORDINATOR_SERVER_NAME
from ibckpt_operator.cluster import webhookcert
from ibckpt_operator.cluster.kube import ApiException, Body, Kube
from ibckpt_operator.machine import internaltls
from ibckpt_operator.machine.internaltls import AgentCert
from ibckpt_operator.machine.webhookcert import WebhookCert

log = logging.getLogger(__name__)
RECHECK_S = 12 * 3600.0


def _agent_cert(secret: Body | None) -> AgentCert | None:
    data = (secret or {}).get("data") or {}
    try:
        return internaltls.agent_from_data({k: base64.b64decode(v) for k, v in data.items()})
    except ValueError:
        return None


async def ensure(
    kube: Kube, namespace: str, ca_secret: str, agent_secret: str, owner: str = ""
) -> WebhookCert:
    """The operator's CA and the coordinator's certificate (from `ca_secret`, made if need be), after
    making sure `agent_secret` holds an agents' certificate that CA signed."""
    ca = await webhookcert.ensure(
        kube, namespace, ca_secret, [COORDINATOR_SERVER_NAME], owner, "internal TLS"
    )
    for attempt in range(webhookcert.ATTEMPTS):
        now = datetime.datetime.now(datetime.UTC)
        existing = await kube.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{agent_secret}")
        why = internaltls.agent_problem(_agent_cert(existing), ca, now)
        if why is None:
            return ca
        cert = internaltls.issue_agent(ca, now)
        last = attempt == webhookcert.ATTEMPTS - 1
        if await webhookcert.write(kube, namespace, agent_secret, cert.data(), existing, owner, last):
            log.info("issued the agents' certificate (%s) into Secret %s/%s", why, namespace, agent_secret)
            return ca
    raise AssertionError("unreachable")  # the last attempt returned or raised


async def keep(
    kube: Kube,
    namespace: str,
    ca_secret: str,
    agent_secret: str,
    owner: str,
    renewed: Callable[[WebhookCert], None],
) -> None:
    """Every RECHECK_S, for as long as this replica leads: ensure() again, and hand its answer to
    `renewed` (the agents' client and the coordinator take a new CA or certificate from it)."""
    while True:
        await asyncio.sleep(RECHECK_S)
        try:
            renewed(await ensure(kube, namespace, ca_secret, agent_secret, owner))
        except (ApiException, OSError) as error:  # the next look tries again, long before any expiry
            log.warning("cannot check the internal TLS Secrets: %s", error)
