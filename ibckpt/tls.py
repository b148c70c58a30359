"""TLS inside an ibckpt release: the names its servers present and the contexts both ends use.

One CA, the operator's (kept in a Secret only the operator reads, docs/security.md), signs the agents'
serving certificate and the coordinator's. A client trusts that CA alone and checks a fixed name, not
the address it dialled: an agent is reached at its node's IP, which no certificate needs to list. The
two names differ, so an agent's certificate (on every node) cannot pass for the coordinator's.
Standard library only: the node image and the operator both import it.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path
from typing import Final

AGENT_SERVER_NAME: Final = "ibckpt-agent"
COORDINATOR_SERVER_NAME: Final = "ibckpt-coordinator"
# The files of the agents' Secret (type kubernetes.io/tls, with the CA beside it), as mounted.
CA_FILE: Final = "ca.crt"
CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"


class TlsSetupError(Exception):
    """A certificate, key or CA bundle that cannot be used: names the file and why."""


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    """Trusts `ca_pem` alone and checks the server's name (given per connection as server_hostname)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by default
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
        raise TlsSetupError(f"the CA bundle is not PEM certificates: {exc}") from exc
    return context


def client_context_from(ca_file: Path) -> ssl.SSLContext:
    try:
        return client_context(ca_file.read_bytes())
    except OSError as exc:
        raise TlsSetupError(f"cannot read the CA bundle {ca_file}: {exc.strerror}") from exc
    except TlsSetupError as exc:
        raise TlsSetupError(f"{ca_file}: {exc}") from exc


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """Serves `cert_file` (the chain, leaf first) with `key_file`; asks nothing of the client."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except OSError as exc:  # ssl.SSLError is one: a key that is not the certificate's, say
        raise TlsSetupError(f"cannot serve {cert_file} with {key_file}: {exc}") from exc
    return context


def server_context_from_pem(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """server_context() for a certificate held in memory (the coordinator's, from the operator's
    Secret): ssl loads keys from files only, so they exist for the load, in a directory only this
    process's user can enter, and are removed at once."""
    with tempfile.TemporaryDirectory(prefix="ibckpt-tls-") as directory:  # mode 0700
        cert_file, key_file = Path(directory) / CERT_FILE, Path(directory) / KEY_FILE
        cert_file.write_bytes(cert_pem)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key_pem)
        return server_context(cert_file, key_file)
