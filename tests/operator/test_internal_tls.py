"""The release's internal TLS: the agents' certificate judged and issued from the operator's CA
(machine/internaltls.py, pure), and, on the real apiserver with the chart's RBAC for the operator's
account, the two Secrets that keep it (cluster/internaltls.py)."""

from __future__ import annotations

import asyncio
import base64
import datetime

import kubernetes
import pytest
from cryptography import x509

from ibckpt.tls import AGENT_SERVER_NAME, COORDINATOR_SERVER_NAME
from ibckpt_operator.cluster import internaltls as kept_in_secrets
from ibckpt_operator.cluster.kube import ApiException, Kube
from ibckpt_operator.machine import internaltls, webhookcert
from testbed.operator_account import OPERATOR_ACCOUNT_NS as RELEASE_NS

NOW = datetime.datetime(2026, 11, 30, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)


def _names(pem: bytes) -> list[str]:
    names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return list(names.value.get_values_for_type(x509.DNSName))


def test_the_agents_certificate_names_the_agents_chains_to_the_ca_and_carries_no_ca_key() -> None:
    ca = webhookcert.issue([COORDINATOR_SERVER_NAME], NOW)
    agent = internaltls.issue_agent(ca, NOW)
    assert _names(agent.tls_crt) == [AGENT_SERVER_NAME] and _names(ca.tls_crt) == [COORDINATOR_SERVER_NAME]
    assert agent.ca_crt == ca.ca_crt and set(agent.data()) == {"ca.crt", "tls.crt", "tls.key"}
    assert ca.ca_key not in agent.data().values()  # node root reads this Secret: it must not mint
    x509.load_pem_x509_certificate(agent.tls_crt).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca.ca_crt)
    )
    assert internaltls.agent_problem(agent, ca, NOW) is None
    assert internaltls.agent_problem(None, ca, NOW) == "no certificate yet"


def test_an_agents_certificate_of_another_ca_or_near_its_end_is_issued_again() -> None:
    ca = webhookcert.issue([COORDINATOR_SERVER_NAME], NOW)
    other = webhookcert.issue([COORDINATOR_SERVER_NAME], NOW)
    foreign = internaltls.issue_agent(other, NOW)
    assert internaltls.agent_problem(foreign, ca, NOW) == "its CA bundle is not the operator's CA"
    spliced = internaltls.AgentCert(ca.ca_crt, foreign.tls_crt, foreign.tls_key)  # the bundle swapped in
    assert internaltls.agent_problem(spliced, ca, NOW) == "the serving certificate does not chain to the CA"
    agent = internaltls.issue_agent(ca, NOW)
    late = NOW + datetime.timedelta(days=webhookcert.SERVING_DAYS) - webhookcert.RENEW_BEFORE + DAY
    assert internaltls.agent_problem(agent, ca, late) is not None
    coordinators = internaltls.AgentCert(ca.ca_crt, ca.tls_crt, ca.tls_key)  # the coordinator's, reused
    assert "names ['ibckpt-coordinator']" in str(internaltls.agent_problem(coordinators, ca, NOW))
    with pytest.raises(ValueError, match="cannot sign"):
        internaltls.issue_agent(ca, NOW + datetime.timedelta(days=webhookcert.CA_DAYS))


@pytest.mark.kube
def test_the_leader_makes_both_secrets_keeps_them_and_reissues_a_foreign_agent_certificate(
    kube_api: kubernetes.client.ApiClient, operator_account: tuple[Kube, str, str]
) -> None:
    kube, webhook_secret, owner = operator_account
    release = webhook_secret.removesuffix("-webhook-cert")
    ca_name, agent_name = f"{release}-internal-tls", f"{release}-agent-tls"
    core = kubernetes.client.CoreV1Api(kube_api)

    def stored(name: str) -> dict[str, bytes]:
        secret = core.read_namespaced_secret(name, RELEASE_NS)
        return {k: base64.b64decode(v) for k, v in secret.data.items()}

    now = datetime.datetime.now(datetime.UTC)
    ca = asyncio.run(kept_in_secrets.ensure(kube, RELEASE_NS, ca_name, agent_name, owner))
    agent = internaltls.agent_from_data(stored(agent_name))
    assert agent is not None and internaltls.agent_problem(agent, ca, now) is None
    assert set(stored(agent_name)) == {"ca.crt", "tls.crt", "tls.key"}  # no CA key where the nodes read
    assert stored(ca_name)["ca.key"] == ca.ca_key
    version = core.read_namespaced_secret(agent_name, RELEASE_NS).metadata.resource_version
    again = asyncio.run(kept_in_secrets.ensure(kube, RELEASE_NS, ca_name, agent_name, owner))
    assert (
        again == ca
        and core.read_namespaced_secret(agent_name, RELEASE_NS).metadata.resource_version == version
    )
    # someone wrote another CA's certificate into the agents' Secret: issued again from the operator's
    other = internaltls.issue_agent(webhookcert.issue([COORDINATOR_SERVER_NAME], now), now)
    encoded = {k: base64.b64encode(v).decode() for k, v in other.data().items()}
    core.patch_namespaced_secret(agent_name, RELEASE_NS, {"data": encoded})
    asyncio.run(kept_in_secrets.ensure(kube, RELEASE_NS, ca_name, agent_name, owner))
    assert stored(agent_name)["ca.crt"] == ca.ca_crt and stored(agent_name)["tls.crt"] != other.tls_crt
    # and no other Secret of the namespace may be rewritten by the operator's account
    core.create_namespaced_secret(RELEASE_NS, {"metadata": {"name": agent_name + "-other"}, "data": {}})
    with pytest.raises(ApiException) as refused:
        asyncio.run(kept_in_secrets.ensure(kube, RELEASE_NS, ca_name, agent_name + "-other", owner))
    assert refused.value.status == 403
