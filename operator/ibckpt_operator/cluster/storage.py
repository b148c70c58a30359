"""Where a job's checkpoint goes: its CheckpointStorage (or in-place location) and credentials Secret,
turned into the image store's configuration, and checked with one cheap request before any pod is touched.

Credentials never leave this module in a message: errors name the Secret and the endpoint, not the keys.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from pathlib import Path

from ibckpt.api import CHECKPOINT_STORAGE, CheckpointStorageSpec, LocalObjectReference, S3Location
from ibckpt.store import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    CredentialsError,
    EndpointUnreachableError,
    ImageStore,
    StoreConfig,
    StoreError,
    credentials_from_secret,
    load_keys,
)
from ibckpt.store.config import EncryptionConfig, config_for_location, encryption_key_from_secret
from ibckpt_operator.cluster.kube import ApiException, Kube, is_status
from ibckpt_operator.config import current


class StorageProblem(Exception):
    """Why the storage cannot be used: `reason` is one CamelCase word for status and Events."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ResolvedStorage:
    location: S3Location
    config: StoreConfig


async def location_of(
    kube: Kube, namespace: str, ref: LocalObjectReference | None, inline: S3Location | None
) -> S3Location:
    if inline is not None:
        return inline
    assert ref is not None
    body = await kube.get_custom(CHECKPOINT_STORAGE.plural, namespace, ref.name)
    if body is None:
        raise StorageProblem("StorageNotFound", f"CheckpointStorage {namespace}/{ref.name} does not exist")
    try:
        return CheckpointStorageSpec.from_wire(body.get("spec", {}))
    except ValueError as error:
        raise StorageProblem("InvalidStorage", f"CheckpointStorage {ref.name}: {error}") from None


GRANT_HINT = "a namespace admin grants it with `kubectl ibckpt grant-storage STORAGE` (docs/helm.md)"


async def _secret(kube: Kube, namespace: str, name: str, what: str) -> dict[str, str] | None:
    """A storage's Secret's data, or None when it does not exist. With the chart's
    storage.operatorSecretAccess=granted, the operator reads only the Secrets a namespace granted."""
    try:
        return await kube.get_secret(namespace, name)
    except ApiException as error:
        if is_status(error, 403):
            raise StorageProblem(
                "SecretNotGranted",
                f"the operator may not read the {what} Secret {namespace}/{name}: {GRANT_HINT}",
            ) from None
        raise


async def resolve(kube: Kube, namespace: str, location: S3Location) -> ResolvedStorage:
    """The store configuration, with the credentials read from the Secret the location names."""
    secret_ref = location.credentials_secret_ref
    data = await _secret(kube, namespace, secret_ref.name, "credentials")
    if data is None:
        raise StorageProblem(
            "SecretNotFound", f"the credentials Secret {namespace}/{secret_ref.name} does not exist"
        )
    try:
        credentials = credentials_from_secret(data, name=f"{namespace}/{secret_ref.name}")
    except ConfigError as error:
        raise StorageProblem("InvalidSecret", str(error)) from None
    ca_bundle = None
    if location.ca_bundle_secret_ref is not None:
        ca_ref = location.ca_bundle_secret_ref
        ca_data = await _secret(kube, namespace, ca_ref.name, "CA bundle")
        key = ca_ref.key or "ca.crt"
        if ca_data is None or key not in ca_data:
            raise StorageProblem(
                "SecretNotFound", f"the CA bundle Secret {namespace}/{ca_ref.name} has no {key}"
            )
        ca_bundle = base64.b64decode(ca_data[key]).decode()
    encryption = EncryptionConfig()
    if location.encryption is not None:
        mode = str(location.encryption.mode)
        client_key = None
        if location.encryption.key_secret_ref is not None:
            key_ref = location.encryption.key_secret_ref
            key_data = await _secret(kube, namespace, key_ref.name, "encryption key")
            if key_data is None:
                raise StorageProblem(
                    "SecretNotFound", f"the encryption key Secret {namespace}/{key_ref.name} does not exist"
                )
            if key_ref.key:
                key_data = {"IBCKPT_ENCRYPTION_KEY": key_data.get(key_ref.key, "")}
            try:
                client_key = encryption_key_from_secret(key_data)
            except ConfigError as error:
                raise StorageProblem("InvalidSecret", str(error)) from None
        encryption = EncryptionConfig.model_validate(
            {"mode": mode, "kms_key_id": location.encryption.kms_key_id, "client_key": client_key}
        )
    try:
        config = config_for_location(location, credentials, encryption)
    except ValueError as error:
        raise StorageProblem("InvalidStorage", f"storage settings: {error}") from None
    if ca_bundle is not None:
        config = _with_ca_file(config, ca_bundle)
    return ResolvedStorage(location, config)


def _with_ca_file(config: StoreConfig, pem: str) -> StoreConfig:
    import tempfile

    # boto3 takes a CA bundle as a path; the file holds no secret (a CA certificate).
    with tempfile.NamedTemporaryFile("w", prefix="ibckpt-ca-", suffix=".pem", delete=False) as handle:
        handle.write(pem)
    return config.with_overrides(ca_bundle=handle.name)


def _problem(error: StoreError) -> StorageProblem:
    if isinstance(error, CredentialsError | AccessDeniedError):
        return StorageProblem("StorageCredentialsRejected", str(error))
    if isinstance(error, EndpointUnreachableError):
        return StorageProblem("StorageUnreachable", str(error))
    if isinstance(error, BucketNotFoundError):
        return StorageProblem("BucketNotFound", str(error))
    return StorageProblem("StorageUnavailable", str(error))


def offline_store(config: StoreConfig) -> ImageStore:
    """The store's keys and layout with no S3 client (any S3 call raises): to sign and verify the manifests
    of the memory tier, which never reach S3 through it."""
    keys_dir = current().image_keys
    try:
        signing = load_keys(Path(keys_dir)) if keys_dir else None
    except StoreError as error:
        raise StorageProblem("ImageKeysUnavailable", str(error)) from None
    return ImageStore.offline(config, signing=signing)


def open_store(config: StoreConfig) -> ImageStore:
    """Connect and head the bucket (blocking: call it in a thread). With the operator's image key set
    (read at each call: a rotated Secret is picked up), what it commits is signed and what it reads must
    verify."""
    keys_dir = current().image_keys
    try:
        signing = load_keys(Path(keys_dir)) if keys_dir else None
    except StoreError as error:
        raise StorageProblem("ImageKeysUnavailable", str(error)) from None
    try:
        return ImageStore.open(config, signing=signing)
    except StoreError as error:
        raise _problem(error) from None


async def check(
    kube: Kube,
    namespace: str,
    ref: LocalObjectReference | None,
    inline: S3Location | None,
    *,
    reach: bool = True,
) -> ResolvedStorage:
    """Resolve the location and its Secrets, then one HEAD on the bucket: a clear reason if any fails.
    `reach=False` skips the HEAD, for work that needs the keys and not the bucket (a restore from memory
    copies alone)."""
    location = await location_of(kube, namespace, ref, inline)
    resolved = await resolve(kube, namespace, location)
    if not reach:
        return resolved
    # the check is quick to give up; the commit, verify and delete that use `resolved` keep the
    # store's own retries and timeouts (a commit through a slow path failed on the check's)
    settings = current()
    quick = resolved.config.model_copy(
        update={
            "max_attempts": settings.s3_check_attempts,
            "connect_timeout": settings.s3_check_timeout,
            "read_timeout": max(settings.s3_check_timeout, 30.0),
        }
    )
    await asyncio.to_thread(open_store, quick)
    return resolved
