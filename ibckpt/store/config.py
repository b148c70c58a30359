"""How to reach the bucket and how to write images: the settings users know from their S3 setups.

Everything can come from environment variables (IBCKPT_S3_*, AWS_*), from command-line flags that override
them, and the credentials also from a Kubernetes Secret's data.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretBytes, SecretStr, field_validator

from ibckpt.store.errors import ConfigError
from ibckpt.store.units import parse_duration, parse_size

if TYPE_CHECKING:
    from ibckpt.api.checkpointjob import CompressionCodec
    from ibckpt.api.storage import S3Location

T = TypeVar("T")

DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 1024 * 1024 * 1024
# On the emulated test nodes one S3 request cost about as much as sending 1 MiB (~1 s each); on the host it
# costs the client about as much CPU as sending 0.5 MiB. Below this, a file shares a pack rather than
# costing a request of its own, and a chunk is PUT without a HEAD first (see upload.py).
DEFAULT_PACK_BELOW = 1024 * 1024
DEFAULT_BLIND_PUT_BELOW = 1024 * 1024

AddressingStyle = Literal["auto", "path", "virtual"]
EncryptionMode = Literal["none", "sse-s3", "sse-kms", "client"]

# Keys accepted in a Secret, in order of preference. The AWS_* names match what `envFrom` would need; the
# short names are what S3-compatible operators (MinIO, Ceph, SeaweedFS charts) tend to generate.
_SECRET_ACCESS_KEY_ID = ("AWS_ACCESS_KEY_ID", "accessKeyID", "accessKeyId", "accessKey", "access-key")
_SECRET_SECRET_KEY = ("AWS_SECRET_ACCESS_KEY", "secretAccessKey", "secretKey", "secret-key")
_SECRET_SESSION_TOKEN = ("AWS_SESSION_TOKEN", "sessionToken", "session-token")
_SECRET_ENCRYPTION_KEY = ("IBCKPT_ENCRYPTION_KEY", "encryptionKey", "encryption-key")


class Credentials(BaseModel):
    """Static credentials. `source` says where they came from, for messages (never the values)."""

    model_config = ConfigDict(frozen=True)

    access_key_id: SecretStr
    secret_access_key: SecretStr
    session_token: SecretStr | None = None
    source: str = "explicit"


class EncryptionConfig(BaseModel):
    """Encryption at rest: by the server (SSE-S3, SSE-KMS), or by ibckpt before upload (AES-256-GCM)."""

    model_config = ConfigDict(frozen=True)

    mode: EncryptionMode = "none"
    kms_key_id: str | None = None
    client_key: SecretBytes | None = Field(default=None, description="32 bytes for mode=client")

    @field_validator("client_key")
    @classmethod
    def _key_length(cls, key: SecretBytes | None) -> SecretBytes | None:
        if key is not None and len(key.get_secret_value()) != 32:
            raise ValueError("the client-side encryption key must be 32 bytes (base64 of 32 random bytes)")
        return key

    def check(self) -> None:
        if self.mode == "client" and self.client_key is None:
            raise ConfigError("encryption mode 'client' needs a key (IBCKPT_ENCRYPTION_KEY or a Secret)")
        if self.mode == "sse-kms" and not self.kms_key_id:
            raise ConfigError("encryption mode 'sse-kms' needs a KMS key id (IBCKPT_S3_SSE_KMS_KEY_ID)")


class StoreConfig(BaseModel):
    """Where the images live and how they are written."""

    model_config = ConfigDict(frozen=True)

    bucket: str
    prefix: str = "ibckpt"
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: AddressingStyle = "auto"
    credentials: Credentials | None = Field(default=None, description="None: the standard AWS chain")
    ca_bundle: str | None = None
    verify_tls: bool = True
    max_attempts: int = Field(default=5, ge=1, le=20)
    retry_mode: Literal["standard", "adaptive"] = "standard"
    connect_timeout: float = Field(default=10.0, gt=0)
    read_timeout: float = Field(default=60.0, gt=0)
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)
    pack_below: int = Field(default=DEFAULT_PACK_BELOW, ge=0, description="0: one chunk per file (schema 1)")
    blind_put_below: int = Field(
        default=DEFAULT_BLIND_PUT_BELOW, ge=0, description="chunks this small are PUT with no HEAD; 0: never"
    )
    compression_level: int = Field(default=3, ge=0, le=22, description="zstd level; 0 turns it off")
    workers: int = Field(default_factory=lambda: min(16, 4 * (os.cpu_count() or 1)), ge=1, le=128)
    multipart_threshold: int = Field(default=64 * 1024 * 1024, ge=5 * 1024 * 1024)
    encryption: EncryptionConfig = EncryptionConfig()
    lease_seconds: float = Field(default=600.0, gt=0, description="writers and readers renew leases")
    max_rate: int | None = Field(default=None, gt=0, description="bytes/s cap on chunk uploads")

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, bucket: str) -> str:
        if not bucket:
            raise ValueError("required (--bucket or IBCKPT_S3_BUCKET)")
        return bucket

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        return prefix.strip("/")

    def where(self) -> str:
        """The endpoint and bucket, for messages."""
        endpoint = self.endpoint_url or f"AWS S3 ({self.region or 'default region'})"
        return f"endpoint {endpoint}, bucket {self.bucket!r}"

    def with_overrides(self, **changes: object) -> StoreConfig:
        """A copy with the given fields replaced (None values are ignored), validated again."""
        data = self.model_dump()
        data.update({key: value for key, value in changes.items() if value is not None})
        return StoreConfig.model_validate(data)

    def for_codec(self, codec: CompressionCodec) -> StoreConfig:
        """A job's spec.compression applied: "none" turns compression off, "zstd" keeps this level."""
        return self if codec == "zstd" else self.with_overrides(compression_level=0)


def config_for_location(
    location: S3Location, credentials: Credentials, encryption: EncryptionConfig | None = None
) -> StoreConfig:
    """The configuration for an API S3Location (a CheckpointStorage's spec, or a job's inline storage):
    the operator and the node agent reach the same bucket the same way."""
    return StoreConfig(
        bucket=location.bucket,
        prefix=location.prefix,
        endpoint_url=location.endpoint or None,
        region=location.region,
        addressing_style=location.addressing_style,
        credentials=credentials,
        encryption=encryption or EncryptionConfig(),
    )


def _secret_text(key: str, value: str | bytes, encoded: bool) -> str:
    raw = value.encode() if isinstance(value, str) else value
    try:
        return (base64.b64decode(raw, validate=True) if encoded else raw).decode().strip()
    except (binascii.Error, ValueError):
        what = "base64 of UTF-8 text (Secret.data values are base64)" if encoded else "UTF-8 text"
        raise ConfigError(f"the Secret's key {key!r} is not valid {what}") from None


def _pick(data: Mapping[str, str | bytes], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in data), None)


def credentials_from_secret(
    data: Mapping[str, str | bytes], *, encoded: bool = True, name: str = "secret"
) -> Credentials:
    """Credentials from a Kubernetes Secret's `data` (base64 values) or `stringData` (encoded=False).

    Accepts AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN and the common short names
    (accessKey, secretKey, ...). Errors list the key names found, never the values.
    """
    id_key = _pick(data, _SECRET_ACCESS_KEY_ID)
    secret_key = _pick(data, _SECRET_SECRET_KEY)
    if id_key is None or secret_key is None:
        raise ConfigError(
            f"Secret {name!r} has no S3 credentials: expected {_SECRET_ACCESS_KEY_ID[0]} and "
            f"{_SECRET_SECRET_KEY[0]} (or accessKey/secretKey); it has keys {sorted(data)}"
        )
    token_key = _pick(data, _SECRET_SESSION_TOKEN)
    token = _secret_text(token_key, data[token_key], encoded) if token_key else None
    return Credentials(
        access_key_id=SecretStr(_secret_text(id_key, data[id_key], encoded)),
        secret_access_key=SecretStr(_secret_text(secret_key, data[secret_key], encoded)),
        session_token=SecretStr(token) if token else None,
        source=f"Secret {name}",
    )


def encryption_key_from_secret(data: Mapping[str, str | bytes], *, encoded: bool = True) -> bytes | None:
    """The client-side encryption key in a Secret (itself base64 of 32 bytes), if the Secret has one."""
    key_name = _pick(data, _SECRET_ENCRYPTION_KEY)
    if key_name is None:
        return None
    return decode_encryption_key(_secret_text(key_name, data[key_name], encoded))


def decode_encryption_key(text: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("the encryption key is not valid base64") from None
    if len(key) != 32:
        raise ConfigError(f"the encryption key must be base64 of 32 bytes, it decodes to {len(key)} bytes")
    return key


def read_secret_dir(path: Path) -> dict[str, bytes]:
    """A Secret mounted as a volume: one file per key, values already decoded."""
    if not path.is_dir():
        raise ConfigError(f"credentials directory {path} does not exist")
    return {
        entry.name: entry.read_bytes()
        for entry in path.iterdir()
        if entry.is_file() and not entry.name.startswith("..")
    }


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def _env_value(env: Mapping[str, str], name: str, parse: Callable[[str], T]) -> T | None:
    """`parse` of variable `name`; None when it is unset or empty; ConfigError naming it when malformed."""
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return parse(value)
    except ValueError as error:
        raise ConfigError(f"{name}: {error}") from None


def config_from_env(
    env: Mapping[str, str] | None = None,
    *,
    encryption_mode: str | None = None,
    kms_key_id: str | None = None,
    client_key: bytes | None = None,
    **overrides: object,
) -> StoreConfig:
    """Build a StoreConfig from IBCKPT_* / AWS_* variables; keyword overrides (e.g. CLI flags) win.

    AWS_ACCESS_KEY_ID and friends are not read here: they are part of the standard AWS chain that boto3
    resolves when `credentials` is None. IBCKPT_S3_CREDENTIALS_DIR points at a mounted Secret instead.
    """
    env = os.environ if env is None else env
    fields: dict[str, object] = {
        "bucket": env.get("IBCKPT_S3_BUCKET", ""),
        "prefix": env.get("IBCKPT_S3_PREFIX"),
        "endpoint_url": env.get("IBCKPT_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL_S3") or None,
        "region": env.get("IBCKPT_S3_REGION") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        "addressing_style": env.get("IBCKPT_S3_ADDRESSING") or None,
        "ca_bundle": env.get("IBCKPT_S3_CA_BUNDLE") or env.get("AWS_CA_BUNDLE") or None,
        "max_attempts": _env_value(env, "IBCKPT_S3_MAX_ATTEMPTS", _integer),
        "connect_timeout": _env_value(env, "IBCKPT_S3_CONNECT_TIMEOUT", parse_duration),
        "read_timeout": _env_value(env, "IBCKPT_S3_READ_TIMEOUT", parse_duration),
        "chunk_size": _env_value(env, "IBCKPT_CHUNK_SIZE", parse_size),
        "pack_below": _env_value(env, "IBCKPT_PACK_BELOW", parse_size),
        "blind_put_below": _env_value(env, "IBCKPT_BLIND_PUT_BELOW", parse_size),
        "compression_level": _env_value(env, "IBCKPT_COMPRESSION_LEVEL", _integer),
        "workers": _env_value(env, "IBCKPT_WORKERS", _integer),
        "lease_seconds": _env_value(env, "IBCKPT_LEASE", parse_duration),
        "max_rate": _env_value(env, "IBCKPT_MAX_RATE", parse_size),
    }
    if env.get("IBCKPT_S3_VERIFY_TLS", "").lower() in {"0", "false", "no"}:
        fields["verify_tls"] = False
    credentials_dir = env.get("IBCKPT_S3_CREDENTIALS_DIR")
    secret_data: dict[str, bytes] = {}
    if credentials_dir:
        secret_data = read_secret_dir(Path(credentials_dir))
        fields["credentials"] = credentials_from_secret(secret_data, encoded=False, name=credentials_dir)
    encryption_mode = encryption_mode or env.get("IBCKPT_ENCRYPTION") or env.get("IBCKPT_S3_SSE") or "none"
    if client_key is not None:
        pass
    elif env.get("IBCKPT_ENCRYPTION_KEY"):
        client_key = decode_encryption_key(env["IBCKPT_ENCRYPTION_KEY"])
    elif env.get("IBCKPT_ENCRYPTION_KEY_FILE"):
        client_key = decode_encryption_key(Path(env["IBCKPT_ENCRYPTION_KEY_FILE"]).read_text())
    elif secret_data:
        client_key = encryption_key_from_secret(secret_data, encoded=False)
    fields["encryption"] = {
        "mode": encryption_mode,
        "kms_key_id": kms_key_id or env.get("IBCKPT_S3_SSE_KMS_KEY_ID") or None,
        "client_key": client_key,
    }
    fields.update(overrides)
    clean = {key: value for key, value in fields.items() if value is not None}
    try:
        config = StoreConfig.model_validate(clean)
    except ValueError as error:
        raise ConfigError(_validation_summary(error)) from None
    config.encryption.check()
    return config


def _validation_summary(error: ValueError) -> str:
    # pydantic's messages echo the input value; keep only the field and the reason (the input may be a key).
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return "invalid store configuration"
    parts = []
    for item in errors(include_input=False):
        where = ".".join(str(part) for part in item.get("loc", ()))
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "invalid store configuration: " + "; ".join(parts)
