"""Staging a node's images to S3: its part of the checkpoint, which the operator commits with the others.

The request names the S3 location and the Secret that holds its credentials; the agent reads the Secret
itself, the endpoint's CA bundle Secret and the client-side encryption key's Secret if the location names
them, all in the storage's namespace (the operator grants the agents `get` on exactly those names there),
so credentials and keys never travel in a request and never reach a report or a log (errors name the
Secret and its keys, never the values).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ibckpt.agentapi import models as api
from ibckpt.api.common import SecretKeyReference
from ibckpt.api.storage import S3Location
from ibckpt.store import (
    EncryptionConfig,
    ImageStore,
    ManifestKeys,
    StoreConfig,
    config_for_location,
    credentials_from_secret,
    load_keys,
)
from ibckpt.store.config import encryption_key_from_secret
from ibckpt.store.context import FollowedSpan, SpanKey
from ibckpt.store.errors import StoreError
from ibckpt.store.follow import Follower
from ibckpt.store.manifest import ContainerDevices, Manifest, RankInfo
from ibckpt.store.upload import CheckpointWriter, ChunkSink, SealedPart
from ibckpt_node.agent.kubesecrets import SecretReader, StagingError


async def read_config(
    secrets: SecretReader, location: S3Location, secret: api.SecretRef, ca_dir: Path
) -> StoreConfig:
    """The store configuration from the request's location and the Secrets it names, read in the
    credentials' namespace (the storage's); a CA bundle becomes a file under `ca_dir`."""
    client_key = None
    if location.encryption is not None and location.encryption.key_secret_ref is not None:
        key_ref = location.encryption.key_secret_ref
        client_key = encryption_key(await secrets(secret.namespace, key_ref.name), secret.namespace, key_ref)
    config = store_config(location, secret, await secrets(secret.namespace, secret.name), client_key)
    ref = location.ca_bundle_secret_ref
    if ref is None:
        return config
    key = ref.key or "ca.crt"
    data = await secrets(secret.namespace, ref.name)
    try:
        pem = base64.b64decode(data[key], validate=True)
    except (KeyError, binascii.Error):
        raise StagingError(f"the CA bundle Secret {secret.namespace}/{ref.name} has no valid {key}") from None
    return config.with_overrides(ca_bundle=str(write_ca(ca_dir, pem)))


def write_ca(ca_dir: Path, pem: bytes) -> Path:
    """Named by its content: one file per bundle, shared by sessions, never rewritten (not a secret)."""
    ca_dir.mkdir(parents=True, exist_ok=True)
    path = ca_dir / f"{hashlib.sha256(pem).hexdigest()[:32]}.pem"
    if not path.exists():
        partial = path.with_suffix(".tmp")
        partial.write_bytes(pem)
        partial.replace(path)
    return path


def encryption_key(data: dict[str, str], namespace: str, ref: SecretKeyReference) -> bytes:
    """The client-side key (32 bytes) from its Secret's data: `ref.key`, else IBCKPT_ENCRYPTION_KEY."""
    try:
        key = encryption_key_from_secret(
            {"IBCKPT_ENCRYPTION_KEY": data.get(ref.key, "")} if ref.key else data
        )
    except StoreError as exc:
        raise StagingError(f"the encryption key Secret {namespace}/{ref.name}: {exc}") from None
    if key is None:
        raise StagingError(
            f"the encryption key Secret {namespace}/{ref.name} has no {ref.key or 'IBCKPT_ENCRYPTION_KEY'}"
        )
    return key


def store_config(
    location: S3Location, secret: api.SecretRef, data: dict[str, str], client_key: bytes | None = None
) -> StoreConfig:
    """Server-side encryption needs only a header on each PUT; client-side the key's bytes (read_config
    reads its Secret), without which mode client is refused here, never silently dropped."""
    encryption = EncryptionConfig()
    if location.encryption is not None:
        mode = str(location.encryption.mode)
        if mode == "client" and client_key is None:
            raise StagingError("client-side encryption needs the key from the storage's keySecretRef")
        kms_key = location.encryption.kms_key_id
        encryption = EncryptionConfig.model_validate(
            {"mode": mode, "kms_key_id": kms_key, "client_key": client_key if mode == "client" else None}
        )
    try:
        credentials = credentials_from_secret(data, name=f"{secret.namespace}/{secret.name}")
    except StoreError as exc:
        raise StagingError(str(exc)) from None
    return config_for_location(location, credentials, encryption)


def image_keys(directory: Path | None) -> ManifestKeys:
    """The agent's image key set, read now (a rotated Secret is picked up); StagingError without one."""
    if directory is None:
        raise StagingError("this agent has no image key set (--image-keys): it stages and restores nothing")
    try:
        return load_keys(directory)
    except StoreError as exc:
        raise StagingError(f"{exc}: the chart mounts them from its image-keys Secret") from None


def upload_config(config: StoreConfig, destination: api.ImageDestination) -> StoreConfig:
    """The configuration the upload writes with: the job's spec.compression applied."""
    return config.for_codec(destination.codec)


def follower(
    config: StoreConfig,
    destination: api.ImageDestination,
    images: Path,
    keys: ManifestKeys,
    timeout: float,
    release: bool = False,
) -> Follower:
    """A follower (not started) of the dump under `images`, with the upload's configuration and keys, so
    that what it stores has the ids and bytes the upload's chunks would have; `release`: it punches what
    it stored of the page files out of the disk (the disk window, diskwindow.py)."""
    store = ImageStore(upload_config(config, destination), signing=keys)
    release_for = destination.checkpoint_id if release else None
    return store.follow(images, destination.job, timeout=timeout, release_for=release_for)


def stage_trees(
    config: StoreConfig,
    destination: api.ImageDestination,
    node: str,
    images_root: Path,
    trees: Sequence[tuple[str, str]],  # (image dir name under images_root, pod name)
    progress: Callable[[int], None],
    keys: ManifestKeys,
    devices: Mapping[str, Mapping[str, Any]] | None = None,
) -> int:
    """Upload each tree under `<node>/<tree>`, compressed as the job asked, and stage them as this node's
    part, signed with `keys`, each tree with its RDMA devices if `devices` (by tree name) has them;
    returns logical bytes."""
    return stage_part(config, destination, node, images_root, trees, progress, keys, devices).logical_bytes


class StagedPart(NamedTuple):
    logical_bytes: int
    store: ImageStore  # as it staged: the memory tier's copy is sealed the same way
    part: Manifest
    released: frozenset[str] = frozenset()  # chunks released from the disk: the copy reads them from S3


def stage_part(
    config: StoreConfig,
    destination: api.ImageDestination,
    node: str,
    images_root: Path,
    trees: Sequence[tuple[str, str]],
    progress: Callable[[int], None],
    keys: ManifestKeys,
    devices: Mapping[str, Mapping[str, Any]] | None = None,
    followed: Mapping[SpanKey, FollowedSpan] | None = None,
) -> StagedPart:
    """stage_trees, keeping what the memory tier's copy needs (agent/memorycopies.py); `followed`: what
    the follower hashed during the dump (FollowStats.spans), not hashed again while it still matches."""
    try:
        store = ImageStore.open(upload_config(config, destination), signing=keys)
        job, checkpoint = destination.job, destination.checkpoint_id
        with store.writer(job, checkpoint, progress=progress, followed=followed) as writer:
            total, ranks = _add_trees(writer, destination, node, images_root, trees, devices)
            part = writer.stage(node, ranks)
        released = frozenset(span.chunk_id for span in (followed or {}).values() if span.released)
        return StagedPart(total, store, part, released)
    except StoreError as exc:
        raise StagingError(f"staging to {config.where()}: {exc}") from exc


def seal_part(
    config: StoreConfig,
    destination: api.ImageDestination,
    node: str,
    images_root: Path,
    trees: Sequence[tuple[str, str]],
    keys: ManifestKeys,
    sink: ChunkSink,
    devices: Mapping[str, Mapping[str, Any]] | None = None,
) -> SealedPart:
    """This node's part as stage_part writes it, with no S3 call: each distinct chunk sealed as stored to
    `sink`, and the signed part manifest returned (the memory tier's copy before the upload). StoreError
    says what failed."""
    store = ImageStore.offline(upload_config(config, destination), signing=keys)
    with store.sealer(destination.job, destination.checkpoint_id, sink) as writer:
        _, ranks = _add_trees(writer, destination, node, images_root, trees, devices)
        return writer.sealed_part(node, ranks)


def _add_trees(
    writer: CheckpointWriter,
    destination: api.ImageDestination,
    node: str,
    images_root: Path,
    trees: Sequence[tuple[str, str]],
    devices: Mapping[str, Mapping[str, Any]] | None,
) -> tuple[int, list[RankInfo]]:
    """Each tree under `<node>/<tree>`: (logical bytes, the ranks, each with its RDMA devices)."""
    total = 0
    ranks = []
    for index, (name, pod) in enumerate(trees):
        root = f"{node}/{name}"
        records = writer.add_tree(images_root / name, under=root)
        total += sum(r.size for r in records)
        used = (devices or {}).get(name)
        ranks.append(
            RankInfo(
                rank=destination.first_rank + index,  # across the job: the commit refuses one twice
                pod=pod,
                node=node,
                root=root,
                devices=ContainerDevices.model_validate(used) if used is not None else None,
            )
        )
    return total, ranks
