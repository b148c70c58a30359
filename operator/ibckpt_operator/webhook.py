"""The admission server the webhooks are served from (kopf's WebhookServer), configured from the
environment; off outside a pod, where the apiserver cannot reach the operator.

- `IBCKPT_WEBHOOK`: `on` / `off`;
- `IBCKPT_WEBHOOK_HOST` (default `$POD_IP`), `IBCKPT_WEBHOOK_PORT` (9443), `IBCKPT_WEBHOOK_BIND` (0.0.0.0);
- `IBCKPT_WEBHOOK_CERT`, `IBCKPT_WEBHOOK_KEY`, `IBCKPT_WEBHOOK_CA`: a certificate issued for the host
  (cert-manager); without them, `IBCKPT_WEBHOOK_SECRET` names the Secret in the operator's namespace that
  keeps a CA and the serving certificate it signs across restarts and upgrades (cluster/webhookcert.py;
  `IBCKPT_WEBHOOK_SECRET_OWNER`, the operator's Deployment, owns it); without that either, a self-signed
  one is made at start-up (tests, a local run) and its CA goes in the caBundle;
- `IBCKPT_WEBHOOK_TIMEOUT` (5): the apiserver's bound on a pod creation's call, in seconds; an
  eviction's is twice that;
- `IBCKPT_WEBHOOK_CLIENT_CA`: the CA that signs the apiserver's client certificate for webhooks; with
  it, a caller without such a certificate is refused in the TLS handshake;
- `IBCKPT_WEBHOOK_MAX_CONNECTIONS` (32): connections served at once; more are closed at once.

kopf's own server has no bound on connections, idle keep-alive (an hour in aiohttp 3.14) or slow
clients, so BoundedWebhookServer serves kopf's handler with them (docs/security.md, "Admission").

The leader writes the configurations (cluster/admission.py), not kopf: handlers/drain.py and
handlers/restorejob.py register the handlers they call.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import functools
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from ibckpt_operator.cluster import webhookcert
from ibckpt_operator.cluster.admission import Endpoint
from ibckpt_operator.cluster.kube import ApiException, Kube, api_message
from ibckpt_operator.machine.webhookcert import WebhookCert

log = logging.getLogger(__name__)
_endpoint: Endpoint | None = None  # where this process serves, once serve_admission set it up
RENEW_EVERY_S = 6 * 3600.0  # how often a running leader asks whether the kept certificate needs renewal


@dataclass
class _Served:
    """The certificate from the Secret this process serves, and the files the server loads it from."""

    settings: WebhookSettings
    cert: WebhookCert
    files: tuple[Path, Path, Path]


_served: _Served | None = None


@dataclass(frozen=True)
class WebhookSettings:
    enabled: bool
    host: str
    port: int
    bind: str
    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    timeout_s: int = 5
    client_ca: str | None = None
    max_connections: int = 32
    secret: str | None = None
    secret_owner: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WebhookSettings:
        env = dict(os.environ if env is None else env)
        switch = env.get("IBCKPT_WEBHOOK", "").lower()
        in_pod = bool(env.get("KUBERNETES_SERVICE_HOST") and env.get("POD_IP"))
        return cls(
            enabled=switch == "on" or (switch != "off" and in_pod),
            host=env.get("IBCKPT_WEBHOOK_HOST") or env.get("POD_IP") or "127.0.0.1",
            port=int(env.get("IBCKPT_WEBHOOK_PORT") or 9443),
            bind=env.get("IBCKPT_WEBHOOK_BIND") or "0.0.0.0",
            certfile=env.get("IBCKPT_WEBHOOK_CERT") or None,
            keyfile=env.get("IBCKPT_WEBHOOK_KEY") or None,
            cafile=env.get("IBCKPT_WEBHOOK_CA") or None,
            timeout_s=max(1, min(15, int(env.get("IBCKPT_WEBHOOK_TIMEOUT") or 5))),
            client_ca=env.get("IBCKPT_WEBHOOK_CLIENT_CA") or None,
            max_connections=max(1, int(env.get("IBCKPT_WEBHOOK_MAX_CONNECTIONS") or 32)),
            secret=env.get("IBCKPT_WEBHOOK_SECRET") or None,
            secret_owner=env.get("IBCKPT_WEBHOOK_SECRET_OWNER") or "",
        )


def self_signed(host: str, directory: Path) -> tuple[Path, Path]:
    """A certificate for `host` (IP or DNS name) signed by its own key: it is its own CA bundle."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = directory / "webhook.crt", directory / "webhook.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    keyfile.chmod(0o600)
    return certfile, keyfile


def endpoint() -> Endpoint | None:
    """What the leader writes into the webhook configurations; None when the webhook is off."""
    return _endpoint


def write_kept(cert: WebhookCert, directory: Path) -> tuple[Path, Path, Path]:
    """The Secret's certificate as the files the server loads: serving certificate, key, CA. Each is
    replaced whole (a renewal rewrites them under the running server, which reloads on a change)."""
    files = (directory / "webhook.crt", directory / "webhook.key", directory / "ca.crt")
    for path, data in zip(files, (cert.tls_crt, cert.tls_key, cert.ca_crt), strict=True):
        partial = path.with_name(path.name + ".new")
        partial.write_bytes(data)
        partial.chmod(0o600)
        partial.replace(path)
    return files


async def renew_served(kube: Kube, namespace: str) -> bool:
    """Renew the certificate this process serves from its Secret when it needs it (expires soon, another
    host, another CA: machine/webhookcert.py), as a start would. True when the files changed: the
    server serves them within CERT_POLL_S, and endpoint() carries the CA a new bundle needs."""
    global _served, _endpoint
    served = _served
    if served is None:  # a certificate of its own (cert-manager renews those files) or of this start
        return False
    webhook = served.settings
    assert webhook.secret is not None
    kept = await webhookcert.ensure(kube, namespace, webhook.secret, [webhook.host], webhook.secret_owner)
    if kept == served.cert:
        return False
    write_kept(kept, served.files[0].parent)
    if kept.ca_crt != served.cert.ca_crt and _endpoint is not None:
        _endpoint = dataclasses.replace(_endpoint, ca_bundle=base64.b64encode(kept.ca_crt).decode())
    _served = dataclasses.replace(served, cert=kept)
    log.info("admission server: renewed its certificate from Secret %s/%s", namespace, webhook.secret)
    return True


async def keep_renewed(kube: Kube, namespace: str, republish: Callable[[Endpoint], Awaitable[Any]]) -> None:
    """The leader's loop: renew every RENEW_EVERY_S; a new CA's bundle is published (`republish`)."""
    while True:
        await asyncio.sleep(RENEW_EVERY_S)
        bundle = _endpoint.ca_bundle if _endpoint is not None else None
        try:
            await renew_served(kube, namespace)
        except ApiException as error:  # the current certificate still serves; try at the next round
            log.warning("admission server: cannot renew its certificate: %s", api_message(error))
            continue
        if _endpoint is not None and _endpoint.ca_bundle != bundle:
            await republish(_endpoint)


async def serve_admission(settings: kopf.OperatorSettings, kube: Kube, namespace: str) -> None:
    """Point kopf's admission server at this pod (or at nowhere, when the webhook is off)."""
    global _endpoint, _served
    _served = None
    webhook = WebhookSettings.from_env()
    if not webhook.enabled:
        # kopf refuses to start with a webhook handler and no server: serve it where nothing calls it.
        settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", host="127.0.0.1", insecure=True)
        log.info("eviction webhook off (IBCKPT_WEBHOOK=on to serve it); the PDBs still hold drains")
        return
    certfile, keyfile, cafile = webhook.certfile, webhook.keyfile, webhook.cafile
    if (certfile is None or keyfile is None) and webhook.secret:
        try:
            kept = await webhookcert.ensure(
                kube, namespace, webhook.secret, [webhook.host], webhook.secret_owner
            )
            files = write_kept(kept, Path(tempfile.mkdtemp(prefix="ibckpt-webhook-")))
            certfile, keyfile, cafile = (str(f) for f in files)
            _served = _Served(webhook, kept, files)
        except ApiException as error:  # the webhooks fail open: serve, with a certificate of this start
            log.error("admission server: Secret %s/%s unusable (%s): a certificate of this start only",
                      namespace, webhook.secret, api_message(error))  # fmt: skip
    if certfile is None or keyfile is None:
        made = self_signed(webhook.host, Path(tempfile.mkdtemp(prefix="ibckpt-webhook-")))
        certfile, keyfile, cafile = str(made[0]), str(made[1]), str(made[0])
    settings.admission.server = BoundedWebhookServer(
        addr=webhook.bind,
        port=webhook.port,
        host=webhook.host,
        certfile=certfile,
        pkeyfile=keyfile,
        cafile=cafile,
        verify_mode=ssl.CERT_REQUIRED if webhook.client_ca else None,
        verify_cafile=webhook.client_ca,
        max_connections=webhook.max_connections,
    )
    bundle = Path(cafile or certfile)  # a given certificate without its CA: it signs itself
    host = f"[{webhook.host}]" if ":" in webhook.host else webhook.host
    _endpoint = Endpoint(
        url=f"https://{host}:{webhook.port}",
        ca_bundle=base64.b64encode(bundle.read_bytes()).decode(),
        eviction_timeout_s=min(30, 2 * webhook.timeout_s),
        creation_timeout_s=webhook.timeout_s,
    )
    log.info(
        "admission webhooks at https://%s:%d (bound to %s; apiserver client certificate %s)",
        webhook.host,
        webhook.port,
        webhook.bind,
        "required" if webhook.client_ca else "not checked",
    )


HANDSHAKE_S = 5.0  # a TLS handshake not done by then is dropped
IDLE_S = 30.0  # a keep-alive connection with no request for this long is closed
LIFETIME_S = 120.0  # any connection is closed after this: a slow client holds a slot no longer
MAX_BODY = 2 * 1024 * 1024  # an AdmissionReview of a pod; the apiserver's own request limit is 3 MiB
CERT_POLL_S = 60.0  # how often the certificate files are looked at (cert-manager renews them)


class _Gate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0


class _Capped(asyncio.Protocol):
    """aiohttp's protocol for one connection, admitted under the cap and closed at LIFETIME_S."""

    def __init__(self, inner: Any, gate: _Gate) -> None:
        self.inner = inner
        self.gate = gate
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.gate.open >= self.gate.limit:
            log.warning("admission server: %d connections open, closing a new one", self.gate.open)
            transport.abort()  # type: ignore[attr-defined]
            return
        self.gate.open += 1
        self.timer = asyncio.get_running_loop().call_later(LIFETIME_S, transport.abort)  # type: ignore[attr-defined]
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.gate.open -= 1
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return bool(self.inner.eof_received())

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _capped(factory: Callable[[], Any], gate: _Gate) -> _Capped:
    return _Capped(factory(), gate)


class BoundedWebhookServer(kopf.WebhookServer):
    """kopf's WebhookServer (its handler, TLS and client-certificate settings) on an aiohttp server with
    bounds: `max_connections`, HANDSHAKE_S, IDLE_S, LIFETIME_S and MAX_BODY. It restarts, as kopf's
    does, when the certificate files change."""

    def __init__(self, *, max_connections: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_connections = max_connections
        self.gate = _Gate(max_connections)
        self.bound_port: int | None = None  # the port served, once serving (port 0: any free one)

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def serve(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        while True:
            cadata, context = self._build_ssl()
            app = aiohttp.web.Application(client_max_size=MAX_BODY)
            app.add_routes([aiohttp.web.post(f"{(self.path or '').rstrip('/')}/{{id:.*}}", serve)])
            runner = aiohttp.web.AppRunner(app, handle_signals=False, keepalive_timeout=IDLE_S)
            await runner.setup()
            try:
                factory: Callable[[], Any] = runner.server  # type: ignore[assignment]
                server = await asyncio.get_running_loop().create_server(
                    functools.partial(_capped, factory, self.gate),
                    self.addr or None,
                    self.port or 0,
                    ssl=context,
                    ssl_handshake_timeout=HANDSHAKE_S if context is not None else None,
                    reuse_address=True,
                )
                self.bound_port = int(server.sockets[0].getsockname()[1])
                schema = "http" if context is None else "https"
                url = self._build_url(schema, self.host or "127.0.0.1", self.bound_port, self.path or "")
                config: dict[str, str] = {"url": url}
                if cadata is not None:
                    config["caBundle"] = base64.b64encode(cadata).decode("ascii")
                try:
                    yield config
                    await self._until_certificates_change()
                finally:
                    server.close()
                    await server.wait_closed()
            finally:
                await runner.cleanup()

    async def _until_certificates_change(self) -> None:
        files = [Path(str(f)) for f in (self.certfile, self.pkeyfile, self.verify_cafile) if f]

        def stamps() -> list[float]:
            return [f.stat().st_mtime if f.exists() else 0.0 for f in files]

        first = stamps()
        while stamps() == first:
            await asyncio.sleep(CERT_POLL_S)
        log.info("admission server: certificate files changed, serving them")
