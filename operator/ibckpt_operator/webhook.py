"""The admission server the webhooks are served from (kopf's WebhookServer), configured from the
environment; off outside a pod, where the apiserver cannot reach the operator.

- `IBCKPT_WEBHOOK`: `on` / `off`;
- `IBCKPT_WEBHOOK_HOST` (default `$POD_IP`), `IBCKPT_WEBHOOK_PORT` (9443), `IBCKPT_WEBHOOK_BIND` (0.0.0.0);
- `IBCKPT_WEBHOOK_CERT`, `IBCKPT_WEBHOOK_KEY`, `IBCKPT_WEBHOOK_CA`: a certificate issued for the host
  (cert-manager); without them a self-signed one is made at start-up and its CA goes in the caBundle;
- `IBCKPT_WEBHOOK_TIMEOUT` (5): the apiserver's bound on a pod creation's call, in seconds; an
  eviction's is twice that.

The leader writes the configurations (cluster/admission.py), not kopf: handlers/drain.py and
handlers/restorejob.py register the handlers they call.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import kopf

from ibckpt_operator.cluster.admission import Endpoint

log = logging.getLogger(__name__)
_endpoint: Endpoint | None = None  # where this process serves, once serve_admission set it up


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


def serve_admission(settings: kopf.OperatorSettings) -> None:
    """Point kopf's admission server at this pod (or at nowhere, when the webhook is off)."""
    global _endpoint
    webhook = WebhookSettings.from_env()
    if not webhook.enabled:
        # kopf refuses to start with a webhook handler and no server: serve it where nothing calls it.
        settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", host="127.0.0.1", insecure=True)
        log.info("eviction webhook off (IBCKPT_WEBHOOK=on to serve it); the PDBs still hold drains")
        return
    certfile, keyfile, cafile = webhook.certfile, webhook.keyfile, webhook.cafile
    if certfile is None or keyfile is None:
        made = self_signed(webhook.host, Path(tempfile.mkdtemp(prefix="ibckpt-webhook-")))
        certfile, keyfile, cafile = str(made[0]), str(made[1]), str(made[0])
    settings.admission.server = kopf.WebhookServer(
        addr=webhook.bind,
        port=webhook.port,
        host=webhook.host,
        certfile=certfile,
        pkeyfile=keyfile,
        cafile=cafile,
    )
    bundle = Path(cafile or certfile)  # a given certificate without its CA: it signs itself
    host = f"[{webhook.host}]" if ":" in webhook.host else webhook.host
    _endpoint = Endpoint(
        url=f"https://{host}:{webhook.port}",
        ca_bundle=base64.b64encode(bundle.read_bytes()).decode(),
        eviction_timeout_s=min(30, 2 * webhook.timeout_s),
        creation_timeout_s=webhook.timeout_s,
    )
    log.info("admission webhooks at https://%s:%d", webhook.host, webhook.port)
