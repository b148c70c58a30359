"""The admission server as served (webhook.BoundedWebhookServer) on 127.0.0.1: the apiserver's client
certificate is required when a CA is given (review N14), and idle, slow or too many connections are
capped and dropped while reviews are still answered."""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ibckpt_operator import webhook
from ibckpt_operator.webhook import BoundedWebhookServer, self_signed

REVIEW = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u1"}}


def _issue(directory: Path, name: str, ca: tuple[x509.Certificate, Any] | None) -> tuple[Path, Path, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer, signer = (ca[0].subject, ca[1]) if ca else (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    crt, pem = directory / f"{name}.crt", directory / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, pem, (cert, key)


async def _review(data: Any, **_: Any) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"allowed": True}}


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """The server with a self-signed serving certificate, requiring client certificates of a CA."""
    certfile, keyfile = self_signed("127.0.0.1", tmp_path)
    ca_crt, _, ca = _issue(tmp_path, "apiserver-ca", None)
    client_crt, client_key, _ = _issue(tmp_path, "kube-apiserver", ca)
    stranger_crt, stranger_key, _ = _issue(tmp_path, "stranger", None)  # signed by nobody we know
    server = BoundedWebhookServer(
        addr="127.0.0.1",
        port=0,
        host="127.0.0.1",
        certfile=str(certfile),
        pkeyfile=str(keyfile),
        verify_mode=ssl.CERT_REQUIRED,
        verify_cafile=str(ca_crt),
        max_connections=4,
    )
    serving = server(_review)
    config = await anext(serving)
    assert config["url"] == f"https://127.0.0.1:{server.bound_port}"
    try:
        yield {
            "server": server,
            "cafile": certfile,
            "client": (client_crt, client_key),
            "stranger": (stranger_crt, stranger_key),
        }
    finally:
        await serving.aclose()


def _context(served: dict[str, Any], who: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(served["cafile"]))
    if who is not None:
        context.load_cert_chain(*(str(p) for p in served[who]))
    return context


async def _post(served: dict[str, Any], who: str | None) -> bytes:
    port = served["server"].bound_port
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_context(served, who))
    body = json.dumps(REVIEW).encode()
    head = "POST /eviction HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


async def test_only_the_apiservers_client_certificate_gets_a_review_answered(served: dict[str, Any]) -> None:
    assert b'"allowed": true' in await _post(served, "client")
    for who in (None, "stranger"):  # no certificate, or one the CA did not sign: no review reaches us
        with pytest.raises((ssl.SSLError, ConnectionError)):
            reply = await _post(served, who)
            assert reply == b"", reply  # TLS 1.3 may report the refusal at the first read instead
            raise ConnectionResetError("closed without an answer")


async def test_idle_and_slow_connections_are_capped_and_dropped(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webhook, "LIFETIME_S", 1.0)
    port = served["server"].bound_port
    # connections that complete the handshake and then drip half a request head
    slow = []
    for _ in range(4):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_context(served, "client"))
        writer.write(b"POST /eviction HTTP/1.1\r\nHost: x\r\n")
        slow.append((reader, writer))
    await asyncio.sleep(0.2)
    assert served["server"].gate.open == 4
    with pytest.raises((ssl.SSLError, ConnectionError)):  # over the cap: closed at once
        reply = await _post(served, "client")
        assert reply == b"", reply
        raise ConnectionResetError("closed without an answer")
    for reader, writer in slow:  # each is dropped at LIFETIME_S however slowly it still sends
        writer.write(b"X")
        assert await asyncio.wait_for(reader.read(), 3) == b""
        writer.close()
    # TCP connections that never start TLS do not count against the cap (HANDSHAKE_S drops them)
    bare = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    assert b'"allowed": true' in await _post(served, "client")
    for sock in bare:
        sock.close()
    for _ in range(50):  # the answered connection's close is seen a moment later
        if served["server"].gate.open == 0:
            break
        await asyncio.sleep(0.05)
    assert served["server"].gate.open == 0
