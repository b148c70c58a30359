"""A release's internal TLS made in a test: a real CA and the certificates the operator issues from it
(the product's own issuance: operator machine/webhookcert.py and machine/internaltls.py)."""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from ibckpt.tls import COORDINATOR_SERVER_NAME, client_context
from ibckpt_operator.machine import internaltls, webhookcert
from ibckpt_operator.machine.internaltls import AgentCert
from ibckpt_operator.machine.webhookcert import WebhookCert


@dataclass(frozen=True)
class Pki:
    ca: WebhookCert  # the operator's CA and the coordinator's certificate, as its Secret holds them
    agent: AgentCert  # as the agents' Secret holds it

    def agent_dir(self, directory: Path) -> Path:
        """The agents' Secret as mounted: ca.crt, tls.crt, tls.key."""
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.agent.data().items():
            (directory / name).write_bytes(data)
        return directory

    def client(self) -> ssl.SSLContext:
        """What the operator's agent client and the agents' coordinator client trust."""
        return client_context(self.ca.ca_crt)


def make_pki() -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca = webhookcert.issue([COORDINATOR_SERVER_NAME], now)
    return Pki(ca, internaltls.issue_agent(ca, now))
