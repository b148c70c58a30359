"""ImageStore: the one object the node agent, the operator and the CLI use to reach checkpoint images."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ibckpt.store import catalog, download, gc, memorycopy, parts
from ibckpt.store.codec import ChunkKeys
from ibckpt.store.config import StoreConfig
from ibckpt.store.context import FollowedSpan, ProgressCallback, SpanKey, StoreContext
from ibckpt.store.errors import ConfigError, StoreError
from ibckpt.store.follow import Follower, follow_context
from ibckpt.store.layout import CheckpointRef, Layout
from ibckpt.store.manifest import Manifest, RankInfo, Versions, parse_manifest
from ibckpt.store.retention import RetentionPolicy
from ibckpt.store.s3 import Connection, check_bucket, connect
from ibckpt.store.signing import ManifestKeys
from ibckpt.store.upload import CheckpointWriter, ChunkSink


def _put_args(config: StoreConfig) -> dict[str, str]:
    mode = config.encryption.mode
    if mode == "sse-s3":
        return {"ServerSideEncryption": "AES256"}
    if mode == "sse-kms":
        return {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": config.encryption.kms_key_id or ""}
    return {}


class _NoS3:
    """The S3 client of a store opened offline: any use is a bug, and says so instead of reaching S3."""

    def __getattr__(self, name: str) -> Any:
        raise StoreError(f"S3 is not used here (the store was opened without it), yet {name} was called")


class ImageStore:
    """`signing`: the image key set (signing.py). Given, every manifest written is signed and every one read
    must verify; the agents and the operator always give it."""

    def __init__(
        self,
        config: StoreConfig,
        connection: Connection | None = None,
        *,
        signing: ManifestKeys | None = None,
    ) -> None:
        config.encryption.check()
        self.config = config
        self.connection = connection or connect(config)
        key = config.encryption.client_key
        keys = (
            ChunkKeys.derive(key.get_secret_value()) if config.encryption.mode == "client" and key else None
        )
        self.context = StoreContext(
            self.connection, Layout(config.prefix), keys, _put_args(config), signing=signing
        )

    @classmethod
    def offline(cls, config: StoreConfig, *, signing: ManifestKeys | None = None) -> ImageStore:
        """The store's keys, codec and layout with no S3 client at all: for what is written to a sink
        (`sealer`) or restored from a manifest and chunks given (the memory tier's)."""
        return cls(config, Connection(_NoS3(), config, "none (offline)"), signing=signing)  # type: ignore[arg-type]

    @classmethod
    def open(cls, config: StoreConfig, *, signing: ManifestKeys | None = None) -> ImageStore:
        """Connect and check that the bucket is there and the credentials are accepted."""
        store = cls(config, signing=signing)
        check_bucket(store.connection)
        return store

    @property
    def client(self):  # type: ignore[no-untyped-def]
        """The boto3 S3 client (tests hook its events to count requests)."""
        return self.connection.client

    # -- catalog ---------------------------------------------------------------------------------------
    def checkpoints(self, job: str | None = None) -> list[catalog.CheckpointEntry]:
        return catalog.list_checkpoints(self.context, job)

    def resolve(self, job: str, checkpoint_id: str) -> CheckpointRef:
        return catalog.resolve(self.context, job, checkpoint_id)

    def manifest(self, ref: CheckpointRef) -> Manifest:
        return self.context.load_manifest(ref)

    def manifest_from(self, ref: CheckpointRef, data: bytes, where: str) -> Manifest:
        """The manifest of `ref` from bytes read elsewhere than its object (`where`, for messages),
        verified as one read from the bucket is: signed for the object key it would have there."""
        key = self.context.layout.manifest_key(ref)
        manifest = parse_manifest(data, f"{ref} ({where})", keys=self.context.signing, object_key=key)
        if manifest.ref != ref:  # the signature binds the key, and so the ref; a plain check costs nothing
            raise StoreError(f"the manifest from {where} is of {manifest.ref}, not {ref}")
        return manifest

    def sign(self, ref: CheckpointRef) -> Manifest:
        """Sign a committed manifest where it lies, unverified as it is: an admin vouches for a checkpoint
        written before manifests were signed (or by hand). Needs the key set."""
        if self.context.signing is None:
            raise ConfigError("signing a checkpoint needs the image key set (--image-keys)")
        manifest = self.context.load_manifest(ref, verified=False)
        key = self.context.layout.manifest_key(ref)
        return self.context.put_manifest(key, manifest, f"signing {ref}")

    def delete(self, ref: CheckpointRef) -> None:
        catalog.delete_checkpoint(self.context, ref)

    # -- writing ---------------------------------------------------------------------------------------
    def writer(
        self,
        job: str,
        checkpoint_id: str | None = None,
        *,
        progress: ProgressCallback | None = None,
        followed: Mapping[SpanKey, FollowedSpan] | None = None,
    ) -> CheckpointWriter:
        """`followed`: a follower's spans (FollowStats.spans) of the trees this writer adds."""
        return CheckpointWriter(self.context, job, checkpoint_id, progress=progress, followed=followed)

    def sealer(self, job: str, checkpoint_id: str, sink: ChunkSink) -> CheckpointWriter:
        """A writer that gives each distinct chunk, sealed as stored, to `sink`, and its part by
        `sealed_part`, with no S3 call (upload.py)."""
        return CheckpointWriter(self.context, job, checkpoint_id, sink=sink)

    def follow(
        self,
        root: Path,
        job: str | None = None,
        *,
        timeout: float | None = None,
        release_for: str | None = None,
    ) -> Follower:
        """Upload the whole chunks of files growing under root (a dump in progress) before the writer of
        the same tree reads them; the writer then skips them (follow.py). Not started yet. `release_for`:
        the checkpoint id, to punch stored page spans out of the disk (end the stats' lease after the
        upload)."""
        return Follower(follow_context(self.context), root, job, timeout=timeout, release_for=release_for)

    def upload_tree(
        self,
        root: Path,
        job: str,
        checkpoint_id: str | None = None,
        *,
        ranks: list[RankInfo] | None = None,
        versions: Versions | None = None,
        labels: dict[str, str] | None = None,
        progress: ProgressCallback | None = None,
    ) -> Manifest:
        """Upload one directory as a whole checkpoint and commit it."""
        with self.writer(job, checkpoint_id, progress=progress) as writer:
            writer.add_tree(root)
            return writer.commit(ranks or [], versions, labels)

    def commit_parts(
        self,
        job: str,
        checkpoint_id: str,
        expected: Sequence[str] | None = None,
        *,
        versions: Versions | None = None,
        labels: dict[str, str] | None = None,
    ) -> Manifest:
        """Merge the parts that nodes staged with `CheckpointWriter.stage` and commit the checkpoint."""
        return parts.commit_parts(
            self.context, job, checkpoint_id, expected, versions=versions, labels=labels
        )

    def abort(self, job: str, checkpoint_id: str) -> int:
        """Drop the staged parts of a checkpoint that will not be committed; its chunks go at the next gc."""
        return parts.delete_parts(self.context, CheckpointRef(job, checkpoint_id))

    # -- reading ---------------------------------------------------------------------------------------
    def restore(
        self,
        ref: CheckpointRef,
        destination: Path,
        *,
        progress: ProgressCallback | None = None,
        subtree: str | None = None,
        chunk_source: download.ChunkSource | None = None,
        manifest: Manifest | None = None,
        source_only: bool = False,
    ) -> download.TransferReport:
        """`manifest`: already read and verified (manifest_from), not read from S3; `source_only`: every
        chunk from `chunk_source`, none from S3 (download.restore)."""
        return download.restore(
            self.context, ref, destination, progress=progress, subtree=subtree, chunk_source=chunk_source,
            manifest=manifest, source_only=source_only,
        )  # fmt: skip

    def stored_chunks(
        self, part: Manifest, root: Path, under: str, from_bucket: Collection[str] = ()
    ) -> Iterator[tuple[str, bytes]]:
        """The chunks of `part`'s files below `under` (a node's directory in the checkpoint), rebuilt from
        the tree at `root` and sealed as stored: the memory tier's copy (memorycopy.py). `from_bucket`:
        those released from the disk during the dump, read from the bucket instead."""
        files = download.select_subtree(part.files, under)
        level = part.compression.level
        return memorycopy.stored_chunks(self.context, files, root, level=level, from_bucket=from_bucket)

    def verify(
        self, ref: CheckpointRef, *, deep: bool = True, progress: ProgressCallback | None = None
    ) -> download.TransferReport:
        return download.verify(self.context, ref, deep=deep, progress=progress)

    # -- garbage collection ------------------------------------------------------------------------------
    def gc(
        self,
        policy: RetentionPolicy,
        *,
        grace: timedelta = gc.DEFAULT_GRACE,
        job: str | None = None,
        dry_run: bool = False,
        sweep: bool = True,
        abandoned_after: timedelta = gc.DEFAULT_ABANDONED_AFTER,
    ) -> gc.GcReport:
        return gc.collect_garbage(
            self.context,
            policy,
            grace=grace,
            job=job,
            dry_run=dry_run,
            sweep=sweep,
            abandoned_after=abandoned_after,
        )
