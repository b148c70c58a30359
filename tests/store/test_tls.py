"""TLS: an S3 endpoint with a private CA works with --ca-bundle and fails clearly without it.

This starts its own SeaweedFS gateway with an HTTPS port and a certificate from a CA made for the test."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pydantic import SecretStr

from ibckpt.store import Credentials, EndpointUnreachableError, ImageStore, StoreConfig
from testbed.ports import free_port
from testbed.s3 import stop_s3_pid, weed_binary

pytestmark = pytest.mark.s3


@dataclass(frozen=True)
class TlsServer:
    https_endpoint: str
    http_endpoint: str
    ca_file: Path
    access_key: str
    secret_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it: (ca.pem, server.pem, server.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("ibckpt test CA"))
        .issuer_name(_name("ibckpt test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_file.chmod(0o600)
    return ca_file, cert_file, key_file


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    root = tmp_path_factory.mktemp("s3-tls")
    ca_file, cert_file, key_file = make_certificates(root)
    access_key, secret_key = "ibckpt-tls-" + secrets.token_hex(4), secrets.token_urlsafe(24)
    identities = {
        "identities": [
            {
                "name": "tls",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (root / "s3.json").write_text(json.dumps(identities))
    (root / "data").mkdir()
    http_port, https_port = free_port(), free_port()
    args = [
        weed_binary(),
        "mini",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={root / 'data'}",
        f"-s3.config={root / 's3.json'}",
        f"-s3.port={http_port}",
        f"-s3.port.https={https_port}",
        f"-s3.cert.file={cert_file}",
        f"-s3.key.file={key_file}",
        f"-master.port={free_port()}",
        f"-volume.port={free_port()}",
        f"-filer.port={free_port()}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",  # no reports to the outside from a test server
    ]
    with open(root / "weed.log", "wb") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, GOMEMLIMIT="256MiB"),
            start_new_session=True,
        )
    try:
        http_endpoint = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"weed exited; see {root / 'weed.log'}"
            try:
                urllib.request.urlopen(http_endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403 to an anonymous request: the gateway is up
            except OSError:
                assert time.monotonic() < deadline, "weed did not start"
                time.sleep(0.2)
        yield TlsServer(f"https://127.0.0.1:{https_port}", http_endpoint, ca_file, access_key, secret_key)
    finally:
        stop_s3_pid(process.pid)


def tls_config(server: TlsServer, **fields: Any) -> StoreConfig:
    base: dict[str, Any] = {
        "bucket": "tls-bucket",
        "endpoint_url": server.https_endpoint,
        "region": "us-east-1",
        "addressing_style": "path",
        "credentials": Credentials(
            access_key_id=SecretStr(server.access_key), secret_access_key=SecretStr(server.secret_key)
        ),
        "max_attempts": 2,
        "connect_timeout": 5.0,
        "read_timeout": 20.0,
        "chunk_size": 64 * 1024,
    }
    return StoreConfig.model_validate(base | fields)


@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
def test_private_ca_needs_the_ca_bundle(tls_server: TlsServer, tmp_path: Path) -> None:
    https = ImageStore(tls_config(tls_server, ca_bundle=str(tls_server.ca_file)))
    https.client.create_bucket(Bucket="tls-bucket")

    with pytest.raises(EndpointUnreachableError) as info:
        ImageStore.open(tls_config(tls_server))
    message = str(info.value)
    assert message.startswith("TLS failed while checking the bucket")
    assert tls_server.https_endpoint in message and "--ca-bundle" in message

    store = ImageStore.open(tls_config(tls_server, ca_bundle=str(tls_server.ca_file)))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "pages.img").write_bytes(os.urandom(200_000))
    manifest = store.upload_tree(tree, "tls-job")
    store.restore(manifest.ref, tmp_path / "out")
    assert (tmp_path / "out" / "pages.img").read_bytes() == (tree / "pages.img").read_bytes()

    # The escape hatch works too (and is the user's explicit choice).
    assert [
        entry.ref for entry in ImageStore.open(tls_config(tls_server, verify_tls=False)).checkpoints()
    ] == [manifest.ref]
