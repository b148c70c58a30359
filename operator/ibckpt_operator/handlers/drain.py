"""Drains: the Node watch (a cordon or an autoscaler's drain taint pokes every protected schedule), the
validating admission webhook on pods/eviction (answered by the schedule's drain machine), and kopf's
admission server that serves it from the operator pod (docs/drains.md).

The webhook server is on in a pod (the apiserver reaches the operator at its pod IP) and off elsewhere;
the environment overrides it:

- `IBCKPT_WEBHOOK`: `on` / `off`;
- `IBCKPT_WEBHOOK_HOST` (default `$POD_IP`), `IBCKPT_WEBHOOK_PORT` (9443), `IBCKPT_WEBHOOK_BIND` (0.0.0.0);
- `IBCKPT_WEBHOOK_CERT`, `IBCKPT_WEBHOOK_KEY`, `IBCKPT_WEBHOOK_CA`: a certificate issued for the host
  (cert-manager); without them a self-signed one is made at start-up and its CA goes in the caBundle.

kopf manages the ValidatingWebhookConfiguration `ibckpt.io` (failurePolicy Ignore: a dead operator must
not block every eviction in the cluster; the PDB is the backstop) and the MutatingWebhookConfiguration of
the same name (the restore binding, handlers/restorejob.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf

from ibckpt_operator import drains, runtime
from ibckpt_operator.machine.core import PodRef
from ibckpt_operator.machine.drain import EvictionAnswer
from ibckpt_operator.schedule_controller import CONTROLLERS
from ibckpt_operator.selection import pod_ref

log = logging.getLogger(__name__)
WEBHOOK_CONFIGURATION = "ibckpt.io"


@kopf.on.event("v1", "nodes")
async def node_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    name = body.get("metadata", {}).get("name")
    if not name:
        return
    draining = type != "DELETED" and drains.node_draining(body)
    if drains.DRAINING.get(name, False) == draining and name in drains.DRAINING:
        return
    drains.DRAINING[name] = draining
    if draining:
        drains.DRAINED_AT[name] = time.time()
        log.info("node %s is being drained", name)
    for controller in list(CONTROLLERS.values()):
        if controller.drain is not None:
            controller.poke()


async def answer_eviction(namespace: str, pod_name: str) -> EvictionAnswer:
    """The answer for an eviction of this pod: the protecting schedule's, or allowed if none protects it
    (or this replica is not running the handlers)."""
    try:
        rt = runtime.get()
    except RuntimeError:
        return EvictionAnswer(True)
    pod = await rt.kube.get_pod(namespace, pod_name)
    if pod is None:
        return EvictionAnswer(True)
    ref: PodRef = pod_ref(pod)
    for controller in list(CONTROLLERS.values()):
        if controller.namespace == namespace and controller.protects(ref.uid):
            return await controller.answer_eviction(ref)
    return EvictionAnswer(True)


@kopf.on.validate(
    "v1", "pods", subresource="eviction", operations=["CREATE"], ignore_failures=True, id="eviction"
)
async def validate_eviction(body: kopf.Body, dryrun: bool, **_: Any) -> None:
    meta = body.get("metadata") or {}
    if dryrun or not meta.get("name"):
        return
    answer = await answer_eviction(meta.get("namespace") or "default", meta["name"])
    if not answer.allowed:
        raise kopf.AdmissionError(answer.message, code=answer.code)


# -- the admission server


@dataclass(frozen=True)
class WebhookSettings:
    enabled: bool
    host: str
    port: int
    bind: str
    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None

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


@kopf.on.startup()
async def admission_server(settings: kopf.OperatorSettings, **_: Any) -> None:
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
    settings.admission.managed = WEBHOOK_CONFIGURATION
    log.info("eviction webhook at https://%s:%d", webhook.host, webhook.port)
