"""A release's internal TLS made in a test: a real CA and the certificates the operator issues from it
(the product's own issuance: operator machine/webhookcert.py and machine/internaltls.py)."""

from __future__ import annotations

import datetime
import functools
import ssl
from dataclasses import dataclass
from pathlib import Path

from ibckpt.tls import COORDINATOR_SERVER_NAME, client_context, server_context_from_pem
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

    def coordinator(self) -> ssl.SSLContext:
        """What the operator's coordinator serves with."""
        return server_context_from_pem(self.ca.tls_crt, self.ca.tls_key)


def make_pki() -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca = webhookcert.issue([COORDINATOR_SERVER_NAME], now)
    return Pki(ca, internaltls.issue_agent(ca, now))


@functools.cache
def shared_pki() -> Pki:
    """One release's TLS for a whole test process: its coordinators and their clients."""
    return make_pki()


def write_test_ca(directory: Path) -> Path:
    """shared_pki()'s CA as a file in `directory` (ibckpt-node --ca-file; a guest's work folder)."""
    path = directory / "coordinator-ca.crt"
    path.write_bytes(shared_pki().ca.ca_crt)
    return path
