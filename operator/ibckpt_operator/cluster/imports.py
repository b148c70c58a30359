"""Checkpoint objects made again from the bucket (`kubectl ibckpt import`, docs/plugin.md).

At its commit, a CheckpointJob writes what the Checkpoint object holds (pods and their templates, rank
keys, required versions, the source) into the manifest's labels, under RECORD_LABEL, before the manifest
is signed with the image keys: the record is as authentic as the images. An import lists the manifests
of one namespace's jobs, reads each one whose Checkpoint object is missing through the store (which
refuses a manifest the image keys do not verify), and creates the object from its record, bound to the
importing CheckpointStorage. A record is only taken for its own namespace and its own manifest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from ibckpt.api import CheckpointSpec
from ibckpt.store import StoreConfig, StoreError
from ibckpt_operator.cluster import storage

log = logging.getLogger(__name__)

RECORD_LABEL = "ibckpt.io/checkpoint"  # a manifest label: the Checkpoint object's spec and labels, JSON
IMPORT_ANNOTATION = "ibckpt.io/import"  # on a CheckpointStorage: any new value asks for an import
IMPORTED_LABEL = "ibckpt.io/imported"  # on a Checkpoint made by an import


def restore_record(spec: CheckpointSpec, labels: dict[str, str]) -> str:
    """The record a manifest carries (without the object's storage: the importer's is used)."""
    wire = spec.to_wire()
    wire.pop("storageRef", None)
    wire.pop("storage", None)
    return json.dumps({"spec": wire, "labels": labels}, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Found:
    """A checkpoint of the bucket to make a Checkpoint object of."""

    name: str
    spec: CheckpointSpec
    labels: dict[str, str]


@dataclass
class Survey:
    found: list[Found] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # checkpoint id -> why


def record_of(text: str | None, job: str, checkpoint_id: str, manifest_key: str, storage_name: str) -> Found:
    """The Checkpoint a manifest's record describes, bound to the importing storage; ValueError: why not."""
    if not text:
        raise ValueError("its manifest has no restore record (taken before imports existed)")
    try:
        record = json.loads(text)
        spec = CheckpointSpec.from_wire(
            {**record["spec"], "storageRef": {"name": storage_name}, "manifestKey": manifest_key}
        )
        labels = {str(k): str(v) for k, v in (record.get("labels") or {}).items()}
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"its restore record is not one: {error}") from None
    if spec.job_name != job or spec.checkpoint_id != checkpoint_id:
        raise ValueError(
            f"its restore record names {spec.job_name}/{spec.checkpoint_id}, not {job}/{checkpoint_id}"
        )
    return Found(checkpoint_id, spec, {**labels, IMPORTED_LABEL: "true"})


def survey(config: StoreConfig, namespace: str, storage_name: str, existing: set[str]) -> Survey:
    """The namespace's checkpoints in the bucket that have no Checkpoint object (blocking)."""
    image_store = storage.open_store(config)
    if image_store.context.signing is None:
        raise storage.StorageProblem(
            "ImageKeysUnavailable", "the operator has no image keys: nothing read from a bucket is trusted"
        )
    result = Survey()
    for entry in image_store.checkpoints():
        ref = entry.ref
        if not ref.job.startswith(f"{namespace}/") or ref.checkpoint_id in existing:
            continue
        try:
            manifest = image_store.manifest(ref)  # verified with the image keys, or refused
            key = image_store.context.layout.manifest_key(ref)
            result.found.append(
                record_of(manifest.labels.get(RECORD_LABEL), ref.job, ref.checkpoint_id, key, storage_name)
            )
        except (StoreError, ValueError) as error:
            result.skipped[ref.checkpoint_id] = str(error)
            log.warning("import into %s: %s skipped: %s", namespace, ref, error)
    return result
