"""The admission server's certificate outlives a restart or upgrade: when the serving certificate is
issued again and when it is kept (machine/webhookcert.py, pure), and, on the real apiserver, the Secret
that keeps it, with the chart's own RBAC for the operator's account (cluster/webhookcert.py): a restarted
operator publishes the same caBundle, and a server started from it is trusted by the old bundle."""

from __future__ import annotations

import asyncio
import base64
import datetime
import ssl
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
from cryptography import x509

from ibckpt_operator import webhook
from ibckpt_operator.cluster import webhookcert as kept_in_secret
from ibckpt_operator.cluster.kube import ApiException, Kube
from ibckpt_operator.machine import webhookcert
from testbed.operator_account import OPERATOR_ACCOUNT_NS

NOW = datetime.datetime(2026, 11, 30, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)


def test_a_fitting_certificate_is_kept_and_anything_else_is_issued_again_by_the_same_ca() -> None:
    first = webhookcert.issue(["10.0.0.7"], NOW)
    assert webhookcert.problem(first, ["10.0.0.7"], NOW) is None
    assert webhookcert.problem(first, ["10.0.0.7"], NOW + 1000 * DAY) is None  # years ahead: still good
    moved = webhookcert.problem(first, ["10.0.0.8"], NOW)  # a new pod IP
    assert moved == "the serving certificate names ['10.0.0.7'], not ['10.0.0.8']"
    assert webhookcert.problem(first, ["10.0.0.7", "ibckpt-webhook.ibckpt-system.svc"], NOW) is not None
    again = webhookcert.issue(["10.0.0.8"], NOW, keep=first)
    assert again.ca_crt == first.ca_crt and again.ca_key == first.ca_key  # the caBundle does not change
    assert again.tls_crt != first.tls_crt and webhookcert.problem(again, ["10.0.0.8"], NOW) is None
    serving = x509.load_pem_x509_certificate(again.tls_crt)
    serving.verify_directly_issued_by(x509.load_pem_x509_certificate(first.ca_crt))


def test_an_expiring_broken_or_foreign_certificate_is_not_served() -> None:
    cert = webhookcert.issue(["ibckpt.example"], NOW)
    late = NOW + datetime.timedelta(days=webhookcert.SERVING_DAYS) - 30 * DAY
    assert webhookcert.problem(cert, ["ibckpt.example"], late) == "the serving certificate expires soon"
    renewed = webhookcert.issue(["ibckpt.example"], late, keep=cert)
    assert renewed.ca_crt == cert.ca_crt  # the CA still has years
    ca_end = NOW + datetime.timedelta(days=webhookcert.CA_DAYS) - 30 * DAY
    assert webhookcert.problem(cert, ["ibckpt.example"], ca_end) == "its CA is invalid or expires soon"
    assert webhookcert.issue(["ibckpt.example"], ca_end, keep=cert).ca_crt != cert.ca_crt
    other = webhookcert.issue(["ibckpt.example"], NOW)
    swapped_key = webhookcert.WebhookCert(cert.ca_crt, cert.ca_key, cert.tls_crt, other.tls_key)
    assert webhookcert.problem(swapped_key, ["ibckpt.example"], NOW) == (
        "the serving key does not match its certificate"
    )
    foreign = webhookcert.WebhookCert(cert.ca_crt, cert.ca_key, other.tls_crt, other.tls_key)
    assert webhookcert.problem(foreign, ["ibckpt.example"], NOW) == (
        "the serving certificate does not chain to the CA"
    )
    bad_ca = webhookcert.WebhookCert(cert.ca_crt, other.ca_key, cert.tls_crt, cert.tls_key)
    assert webhookcert.problem(bad_ca, ["ibckpt.example"], NOW) == "its CA is invalid or expires soon"
    assert webhookcert.problem(None, ["ibckpt.example"], NOW) == "no certificate yet"
    assert webhookcert.from_data({"ca.crt": b"x", "tls.crt": b"y"}) is None
    assert webhookcert.from_data(cert.data()) == cert


# -- on the real apiserver, as the operator's account with the chart's RBAC ------------------------------

RELEASE_NS = OPERATOR_ACCOUNT_NS  # the operator_account fixture's (conftest.py)


def _secret(kube_api: kubernetes.client.ApiClient, name: str) -> Any:
    return kubernetes.client.CoreV1Api(kube_api).read_namespaced_secret(name, RELEASE_NS)


@pytest.mark.kube
def test_the_secret_is_made_once_reused_at_restart_and_reissued_by_its_ca_for_a_new_host(
    kube_api: kubernetes.client.ApiClient, operator_account: tuple[Kube, str, str]
) -> None:
    kube, name, owner = operator_account
    first = asyncio.run(kept_in_secret.ensure(kube, RELEASE_NS, name, ["10.1.0.5"], owner))
    made = _secret(kube_api, name)
    assert made.type == "kubernetes.io/tls" and set(made.data) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    assert [(o.kind, o.name) for o in made.metadata.owner_references] == [("Deployment", owner)]
    assert made.metadata.labels == {"app.kubernetes.io/managed-by": "ibckpt-operator"}

    restarted = asyncio.run(kept_in_secret.ensure(kube, RELEASE_NS, name, ["10.1.0.5"], owner))
    assert restarted == first  # the same certificate, and the Secret was not written
    assert _secret(kube_api, name).metadata.resource_version == made.metadata.resource_version

    moved = asyncio.run(kept_in_secret.ensure(kube, RELEASE_NS, name, ["10.1.0.9"], owner))  # a new pod IP
    assert moved.ca_crt == first.ca_crt and moved.tls_crt != first.tls_crt
    stored = webhookcert.from_data({k: base64.b64decode(v) for k, v in _secret(kube_api, name).data.items()})
    assert stored == moved

    # two replicas starting at once: one writes, the other reads what it wrote
    kubernetes.client.CoreV1Api(kube_api).delete_namespaced_secret(name, RELEASE_NS)

    async def both() -> list[webhookcert.WebhookCert]:
        return list(await asyncio.gather(*(kept_in_secret.ensure(kube, RELEASE_NS, name, ["10.1.0.9"], owner)
                                           for _ in range(2))))  # fmt: skip

    one, other = asyncio.run(both())
    assert one == other and one.ca_crt != first.ca_crt  # the Secret was gone: a new CA


@pytest.mark.kube
def test_the_chart_lets_the_operator_write_only_its_own_secret(
    kube_api: kubernetes.client.ApiClient, operator_account: tuple[Kube, str, str]
) -> None:
    kube, name, owner = operator_account
    other = {"metadata": {"name": name + "-other"}, "stringData": {"password": "x"}}
    kubernetes.client.CoreV1Api(kube_api).create_namespaced_secret(RELEASE_NS, other)
    with pytest.raises(ApiException) as refused:  # another Secret of the namespace: not rewritten
        asyncio.run(kept_in_secret.ensure(kube, RELEASE_NS, name + "-other", ["10.1.0.5"], owner))
    assert refused.value.status == 403
    assert _secret(kube_api, name + "-other").data == {"password": base64.b64encode(b"x").decode()}
    with pytest.raises(ApiException) as elsewhere:  # nor made in another namespace
        asyncio.run(kept_in_secret.ensure(kube, "default", name, ["10.1.0.5"], ""))
    assert elsewhere.value.status == 403


@pytest.mark.kube
async def test_a_restarted_operator_serves_a_certificate_the_published_bundle_trusts(
    operator_account: tuple[Kube, str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kube, name, owner = operator_account
    for key, value in {"IBCKPT_WEBHOOK": "on", "IBCKPT_WEBHOOK_HOST": "127.0.0.1", "IBCKPT_WEBHOOK_PORT": "0",
                       "IBCKPT_WEBHOOK_BIND": "127.0.0.1", "IBCKPT_WEBHOOK_SECRET": name,
                       "IBCKPT_WEBHOOK_SECRET_OWNER": owner}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    before = kopf.OperatorSettings()
    await webhook.serve_admission(before, kube, RELEASE_NS)
    published = webhook.endpoint()
    assert published is not None
    after = kopf.OperatorSettings()  # the next start (a restart, or the upgraded release's pod)
    await webhook.serve_admission(after, kube, RELEASE_NS)
    again = webhook.endpoint()
    assert again is not None and again.ca_bundle == published.ca_bundle
    server = after.admission.server
    serving = server(lambda *_a, **_k: None)
    await anext(serving)
    try:
        bundle = tmp_path / "bundle.pem"
        bundle.write_bytes(base64.b64decode(published.ca_bundle))
        context = ssl.create_default_context(cafile=str(bundle))  # as the apiserver checks it
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port, ssl=context)
        writer.close()
    finally:
        await serving.aclose()


@pytest.mark.kube
async def test_an_operator_that_may_not_use_the_secret_still_serves(
    kube_api: kubernetes.client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The webhooks fail open: a Secret it cannot read or write costs the stable bundle, not the server."""
    nobody = kubernetes.client.ApiClient(kube_api.configuration)
    nobody.set_default_header("Impersonate-User", "system:serviceaccount:default:nobody")
    for key, value in {"IBCKPT_WEBHOOK": "on", "IBCKPT_WEBHOOK_HOST": "127.0.0.1",
                       "IBCKPT_WEBHOOK_SECRET": "webhook-cert"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    settings = kopf.OperatorSettings()
    await webhook.serve_admission(settings, Kube(nobody), RELEASE_NS)
    published = webhook.endpoint()
    assert published is not None and isinstance(settings.admission.server, webhook.BoundedWebhookServer)
    certificate = x509.load_pem_x509_certificate(base64.b64decode(published.ca_bundle))
    assert certificate.subject.rfc4514_string() == "CN=127.0.0.1"  # this start's own, not a kept CA


@pytest.mark.kube
async def test_a_running_server_takes_a_renewed_certificate_without_a_restart(
    operator_account: tuple[Kube, str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The leader asks every RENEW_EVERY_S whether the Secret's certificate still fits (here: it was made
    for another host, as an expiring one would be judged): the new one is written under the running
    server, which serves it at its next look at the files, and the published bundle still trusts it."""
    kube, name, owner = operator_account
    for key, value in {"IBCKPT_WEBHOOK": "on", "IBCKPT_WEBHOOK_HOST": "127.0.0.1", "IBCKPT_WEBHOOK_PORT": "0",
                       "IBCKPT_WEBHOOK_BIND": "127.0.0.1", "IBCKPT_WEBHOOK_SECRET": name,
                       "IBCKPT_WEBHOOK_SECRET_OWNER": owner}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(webhook, "CERT_POLL_S", 0.2)
    settings = kopf.OperatorSettings()
    await webhook.serve_admission(settings, kube, RELEASE_NS)
    published = webhook.endpoint()
    assert published is not None
    assert not await webhook.renew_served(kube, RELEASE_NS)  # nothing to renew yet
    server = settings.admission.server
    serving = server(lambda *_a, **_k: None)
    await anext(serving)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(base64.b64decode(published.ca_bundle))
    context = ssl.create_default_context(cafile=str(bundle))

    async def presented() -> bytes:
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port, ssl=context)
        der: bytes = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return der

    watcher = asyncio.ensure_future(anext(serving, None))  # the server's wait for changed files
    try:
        before = await presented()
        secret = await kube.request("GET", f"/api/v1/namespaces/{RELEASE_NS}/secrets/{name}")
        assert secret is not None
        kept = webhookcert.from_data({k: base64.b64decode(v) for k, v in secret["data"].items()})
        assert kept is not None
        elsewhere = webhookcert.issue(["10.9.9.9"], datetime.datetime.now(datetime.UTC), keep=kept)
        secret["data"] = {k: base64.b64encode(v).decode() for k, v in elsewhere.data().items()}
        await kube.request("PUT", f"/api/v1/namespaces/{RELEASE_NS}/secrets/{name}", secret)
        assert await webhook.renew_served(kube, RELEASE_NS)
        again = webhook.endpoint()
        assert again is not None and again.ca_bundle == published.ca_bundle  # same CA: no new bundle
        assert await asyncio.wait_for(watcher, 10)  # it saw the files change and serves them again
        after = await presented()
        assert after != before
        renewed = x509.load_der_x509_certificate(after)
        assert renewed.serial_number != x509.load_der_x509_certificate(before).serial_number
    finally:
        watcher.cancel()
        await serving.aclose()
