"""The release's own TLS: the agents' serving certificate, judged and issued from the operator's CA (pure).

The CA and the coordinator's certificate live in one Secret only the operator reads (a WebhookCert:
CA, CA key, serving certificate for ibckpt.tls.COORDINATOR_SERVER_NAME; judged by machine/webhookcert.py).
The agents' Secret holds their serving certificate for ibckpt.tls.AGENT_SERVER_NAME, its key and the
CA certificate, never the CA's key: a node's root can read the agents' Secret, and must not be able to
mint a certificate the coordinator's clients or the operator would trust.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from ibckpt.tls import AGENT_SERVER_NAME, CA_FILE, CERT_FILE, KEY_FILE
from ibckpt_operator.machine import webhookcert
from ibckpt_operator.machine.webhookcert import WebhookCert


@dataclass(frozen=True)
class AgentCert:
    """PEM bytes: the CA the agents trust the coordinator by, and their serving certificate and key."""

    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes

    def data(self) -> dict[str, bytes]:
        return {CA_FILE: self.ca_crt, CERT_FILE: self.tls_crt, KEY_FILE: self.tls_key}


def agent_from_data(data: Mapping[str, bytes]) -> AgentCert | None:
    """The certificate an agents' Secret (decoded) holds; None if a key is missing."""
    if not all(data.get(key) for key in (CA_FILE, CERT_FILE, KEY_FILE)):
        return None
    return AgentCert(data[CA_FILE], data[CERT_FILE], data[KEY_FILE])


def agent_problem(agent: AgentCert | None, ca: WebhookCert, now: datetime.datetime) -> str | None:
    """Why the agents' certificate must be issued again (None: it serves as it is)."""
    if agent is None:
        return "no certificate yet"
    if agent.ca_crt != ca.ca_crt:
        return "its CA bundle is not the operator's CA"
    as_issued = WebhookCert(ca.ca_crt, ca.ca_key, agent.tls_crt, agent.tls_key)
    return webhookcert.problem(as_issued, [AGENT_SERVER_NAME], now)


def issue_agent(ca: WebhookCert, now: datetime.datetime) -> AgentCert:
    """A serving certificate for the agents' name signed by `ca` (which must be able to sign)."""
    if not webhookcert.usable_ca(ca, now):
        raise ValueError("the operator's CA cannot sign (invalid or expiring): renew it first")
    made = webhookcert.issue([AGENT_SERVER_NAME], now, ca)
    return AgentCert(made.ca_crt, made.tls_crt, made.tls_key)
