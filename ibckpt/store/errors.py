"""Errors of the image store.

Every message names the endpoint and the bucket (or the checkpoint and chunk) so that an operator can act on
it, and never a credential: only where the credentials came from.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the image store raises on purpose."""


class ConfigError(StoreError):
    """The store configuration is incomplete or inconsistent."""


class CredentialsError(StoreError):
    """No credentials were found, or the server rejected them."""


class BucketNotFoundError(StoreError):
    """The configured bucket does not exist on the endpoint."""


class AccessDeniedError(StoreError):
    """The credentials are valid but not allowed to do this."""


class EndpointUnreachableError(StoreError):
    """The endpoint did not answer: refused, DNS, TLS or timeout."""


class CheckpointNotFoundError(StoreError):
    """No committed manifest exists for the checkpoint asked for."""


class CheckpointExistsError(StoreError):
    """A commit found the checkpoint already committed: a manifest is never replaced."""


class ManifestError(StoreError):
    """A manifest could not be parsed or has an unsupported schema version."""


class ManifestSignatureError(ManifestError):
    """A manifest is unsigned, signed with a key not in the image key set, or does not verify."""


class ChunkError(StoreError):
    """A chunk is missing or does not match its recorded hash."""

    def __init__(self, message: str, *, chunk_id: str, checkpoint: str) -> None:
        super().__init__(message)
        self.chunk_id = chunk_id
        self.checkpoint = checkpoint


class ChunkMissingError(ChunkError):
    """A chunk that a manifest references is not in the bucket."""


class ChunkCorruptError(ChunkError):
    """A chunk's bytes do not decode to content with its recorded hash."""


class LeaseError(StoreError):
    """A writer lost its lease (heartbeats failed) or waited too long for a garbage collection sweep."""


class EncryptionError(StoreError):
    """Client-side encryption is misconfigured, or a chunk was encrypted with another key."""
