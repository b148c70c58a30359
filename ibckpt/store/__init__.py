"""The checkpoint image store on S3: chunked, compressed, deduplicated, verified, committed atomically.

Start from ImageStore (store.py) and StoreConfig / config_from_env (config.py); docs/image-store.md has the
design and the numbers.
"""

from ibckpt.store.config import (
    Credentials,
    EncryptionConfig,
    StoreConfig,
    config_for_location,
    config_from_env,
    credentials_from_secret,
)
from ibckpt.store.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkCorruptError,
    ChunkError,
    ChunkMissingError,
    ConfigError,
    CredentialsError,
    EndpointUnreachableError,
    ManifestError,
    ManifestSignatureError,
    StoreError,
)
from ibckpt.store.layout import CheckpointRef
from ibckpt.store.manifest import Manifest, RankInfo, Versions
from ibckpt.store.retention import RetentionPolicy
from ibckpt.store.signing import ManifestKeys, load_keys
from ibckpt.store.store import ImageStore

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointRef",
    "ChunkCorruptError",
    "ChunkError",
    "ChunkMissingError",
    "ConfigError",
    "Credentials",
    "CredentialsError",
    "EncryptionConfig",
    "EndpointUnreachableError",
    "ImageStore",
    "Manifest",
    "ManifestError",
    "ManifestKeys",
    "ManifestSignatureError",
    "RankInfo",
    "RetentionPolicy",
    "StoreConfig",
    "StoreError",
    "Versions",
    "config_for_location",
    "config_from_env",
    "credentials_from_secret",
    "load_keys",
]
