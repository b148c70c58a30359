"""The admission server's certificate: a CA kept for years and a serving certificate it signs (pure).

The apiserver trusts the webhooks' `caBundle`. A certificate made afresh at every start changed that
bundle with every restart and `helm upgrade`, so until the new leader rewrote the configurations the
apiserver refused the server (failurePolicy Ignore: drains went unguarded). Both live in one Secret the
operator owns (cluster/webhookcert.py): the CA is reused while it is valid, so the bundle stays the
same; the serving certificate is issued again only when it is missing, expires soon, names other hosts
or no longer chains to the CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_DAYS = 3650
SERVING_DAYS = 1825  # a running replica does not renew: long enough to outlive any replica
RENEW_BEFORE = datetime.timedelta(days=90)  # a start this close to an expiry issues again
# The Secret's keys: kubernetes.io/tls's two, and the CA's.
TLS_CRT, TLS_KEY, CA_CRT, CA_KEY = "tls.crt", "tls.key", "ca.crt", "ca.key"


@dataclass(frozen=True)
class WebhookCert:
    """PEM bytes of the CA and of the serving certificate it signed."""

    ca_crt: bytes
    ca_key: bytes
    tls_crt: bytes
    tls_key: bytes

    def data(self) -> dict[str, bytes]:
        return {CA_CRT: self.ca_crt, CA_KEY: self.ca_key, TLS_CRT: self.tls_crt, TLS_KEY: self.tls_key}


def from_data(data: Mapping[str, bytes]) -> WebhookCert | None:
    """The certificate a Secret's (decoded) data holds; None if a key is missing."""
    if not all(data.get(key) for key in (CA_CRT, CA_KEY, TLS_CRT, TLS_KEY)):
        return None
    return WebhookCert(data[CA_CRT], data[CA_KEY], data[TLS_CRT], data[TLS_KEY])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _normal(host: str) -> str:
    """An IP as the certificate prints it (::1, not 0:0::1); a DNS name as given."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _names(cert: x509.Certificate) -> set[str]:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in sans.get_values_for_type(x509.IPAddress)} | set(
        sans.get_values_for_type(x509.DNSName)
    )


def _fresh(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return cert.not_valid_before_utc <= now and now + RENEW_BEFORE < cert.not_valid_after_utc


def _key(pem: bytes) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except ValueError:
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def _matches(key: ec.EllipticCurvePrivateKey | None, cert: x509.Certificate) -> bool:
    """`key` is the private half of `cert`'s public key."""
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return key is not None and key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def usable_ca(cert: WebhookCert | None, now: datetime.datetime) -> bool:
    """The CA can go on signing: it parses, is a CA, its key is its own, and it does not expire soon."""
    if cert is None:
        return False
    try:
        ca = x509.load_pem_x509_certificate(cert.ca_crt)
        constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    return constraints.ca and _matches(_key(cert.ca_key), ca) and _fresh(ca, now)


def problem(cert: WebhookCert | None, hosts: Iterable[str], now: datetime.datetime) -> str | None:
    """Why `cert` cannot be served for `hosts` as it is (it is issued again then); None: it can."""
    if cert is None:
        return "no certificate yet"
    if not usable_ca(cert, now):
        return "its CA is invalid or expires soon"
    try:
        serving = x509.load_pem_x509_certificate(cert.tls_crt)
        ca = x509.load_pem_x509_certificate(cert.ca_crt)
        serving.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "the serving certificate does not chain to the CA"
    if not _matches(_key(cert.tls_key), serving):
        return "the serving key does not match its certificate"
    if not _fresh(serving, now):
        return "the serving certificate expires soon"
    wanted = {_normal(h) for h in hosts}
    if _names(serving) != wanted:
        return f"the serving certificate names {sorted(_names(serving))}, not {sorted(wanted)}"
    return None


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
    signer: ec.EllipticCurvePrivateKey, days: int, now: datetime.datetime, hosts: list[str] | None,
) -> x509.Certificate:  # fmt: skip
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.BasicConstraints(ca=hosts is None, path_length=0 if hosts is None else None), critical=True
        )
    )
    if hosts is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def issue(hosts: list[str], now: datetime.datetime, keep: WebhookCert | None = None) -> WebhookCert:
    """A serving certificate for `hosts`, signed by `keep`'s CA when that can still sign, else by a new
    CA (the webhooks' caBundle then changes once)."""
    if keep is not None and usable_ca(keep, now):
        ca_crt, ca_key_pem = keep.ca_crt, keep.ca_key
        ca_key = _key(ca_key_pem)
        assert ca_key is not None  # usable_ca checked it
        ca_name = x509.load_pem_x509_certificate(ca_crt).subject
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _certificate("ibckpt webhook CA", ca_key, None, ca_key, CA_DAYS, now, None)
        ca_crt, ca_key_pem, ca_name = (
            ca.public_bytes(serialization.Encoding.PEM),
            _pem_key(ca_key),
            ca.subject,
        )
    key = ec.generate_private_key(ec.SECP256R1())
    serving = _certificate(hosts[0], key, ca_name, ca_key, SERVING_DAYS, now, hosts)
    return WebhookCert(ca_crt, ca_key_pem, serving.public_bytes(serialization.Encoding.PEM), _pem_key(key))
