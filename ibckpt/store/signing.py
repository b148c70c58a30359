"""Manifest signatures: an HMAC-SHA256 over a manifest's canonical bytes and the object key it is stored at.

Whoever holds a prefix's S3 keys (the tenant) can write manifests and parts there; the agents restore them as
root. A signature made with a key only the agents and the operator hold says the manifest was written by
them, for this place: a manifest copied to another checkpoint, job, namespace or prefix does not verify,
because its object key is inside the MAC. Chunks need no signature of their own: the signed manifest names
each one by the hash of its bytes, which the download checks before it writes them (download.fetch_chunk).

The key set is a directory of files, one per key, named by the key id (a mounted Secret): the greatest id
signs, every id verifies, so an admin rotates by adding a key with a later id (docs/image-store.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibckpt.store.errors import ConfigError, ManifestSignatureError

# The key set's directory, for the CLI and the operator (the agent reads the same variable).
KEYS_DIR_ENV = "IBCKPT_IMAGE_KEYS"
KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MIN_KEY_BYTES = 32
SIGNATURE_FIELD = "signature"
_DOMAIN = b"ibckpt manifest signature v1"


@dataclass(frozen=True)
class ManifestKeys:
    """The key set: id -> secret bytes. Never printed (repr shows the ids only)."""

    keys: Mapping[str, bytes]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ConfigError("an image key set needs at least one key")
        for key_id, secret in self.keys.items():
            if not KEY_ID.match(key_id):
                raise ConfigError(f"image key id {key_id!r} is not a name (letters, digits, '.', '_', '-')")
            if len(secret) < MIN_KEY_BYTES:
                raise ConfigError(f"image key {key_id!r} has {len(secret)} bytes; at least {MIN_KEY_BYTES}")

    def __repr__(self) -> str:
        return f"ManifestKeys(ids={sorted(self.keys)})"

    @property
    def signing_id(self) -> str:
        """The newest key: the greatest id."""
        return max(self.keys)

    def sign(self, raw: dict[str, Any], object_key: str) -> dict[str, str]:
        """The signature field for manifest `raw` (a parsed manifest) stored at `object_key`."""
        key_id = self.signing_id
        return {"key_id": key_id, "mac": _mac(self.keys[key_id], key_id, object_key, raw)}

    def verify(self, raw: dict[str, Any], object_key: str, where: str) -> str:
        """The id of the key that signed `raw` at `object_key`; ManifestSignatureError naming `where` if it
        is unsigned, signed with a key not in the set, or does not verify (edited, or copied elsewhere)."""
        signature = raw.get(SIGNATURE_FIELD)
        if signature is None:
            raise ManifestSignatureError(f"manifest {where} is not signed: refused (ibckpt did not write it)")
        if not isinstance(signature, dict) or not isinstance(signature.get("key_id"), str):
            raise ManifestSignatureError(f"manifest {where} has a malformed signature: refused")
        key_id: str = signature["key_id"]
        mac = signature.get("mac")
        secret = self.keys.get(key_id)
        if secret is None:
            raise ManifestSignatureError(
                f"manifest {where} is signed with key {key_id!r}, which is not in the image key set "
                f"({', '.join(sorted(self.keys))}): refused"
            )
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, key_id, object_key, raw)):
            raise ManifestSignatureError(
                f"manifest {where} does not match its signature (key {key_id!r}): it was changed after "
                "signing or copied from another checkpoint: refused"
            )
        return key_id


def canonical(raw: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, keys sorted, no spaces."""
    unsigned = {name: value for name, value in raw.items() if name != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _mac(secret: bytes, key_id: str, object_key: str, raw: dict[str, Any]) -> str:
    # Length-prefixed fields: no two (key id, object key, manifest) triples give the same message.
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    for field in (key_id.encode(), object_key.encode(), canonical(raw)):
        mac.update(len(field).to_bytes(8, "big"))
        mac.update(field)
    return mac.hexdigest()


def load_keys(directory: Path) -> ManifestKeys:
    """The key set in `directory` (one file per key, named by its id; dot files such as a mounted Secret's
    `..data` are skipped). ConfigError says what is missing, never a key's bytes."""
    try:
        names = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    except OSError as error:
        raise ConfigError(f"no image signing keys: cannot read {directory}: {error.strerror}") from None
    keys: dict[str, bytes] = {}
    for name in names:
        path = directory / name
        if path.is_file():
            keys[name] = path.read_bytes()
    if not keys:
        raise ConfigError(f"no image signing keys in {directory}")
    return ManifestKeys(keys)
