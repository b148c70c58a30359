"""Host tests: a checkpoint records the shim build its container's processes map, from the node's side
(the hook's registration, the dump's tree manifest), and the restore's staging carries it on."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node import container_runtime
from ibckpt_node.agent import restoring
from ibckpt_node.hook import oci, stages
from ibckpt_node.trees import SHIM_BUILD, TREE_MANIFEST

BUILD = "ef" * 32


def bundle_with(tmp_path: Path, shim: str) -> container_runtime.RuntimeContainer:
    config = oci.NodeConfig(shim=shim, state_dir=str(tmp_path / "state"))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(
        json.dumps(oci.edit_spec(with_device(containerd_spec()), config, "c1"))
    )
    return container_runtime.RuntimeContainer("c1", "/usr/sbin/runc", "/run/runc", str(bundle))


def test_the_dump_records_the_build_the_container_mounts(tmp_path: Path) -> None:
    container = bundle_with(tmp_path, f"/usr/local/lib/ibckpt/builds/{BUILD}/libibckpt.so")
    assert container_runtime.shim_build(container) == BUILD


def test_a_container_from_before_builds_records_the_digest_of_its_file(tmp_path: Path) -> None:
    legacy = tmp_path / "libibckpt.so"
    legacy.write_bytes(b"\x7fELF before builds")
    container = bundle_with(tmp_path, str(legacy))
    assert container_runtime.shim_build(container) == hashlib.sha256(b"\x7fELF before builds").hexdigest()
    legacy.unlink()
    assert container_runtime.shim_build(container) is None, "a file it cannot read records nothing"


def test_the_hooks_registration_names_the_build_it_mounted(tmp_path: Path) -> None:
    config = oci.NodeConfig(shim=f"/x/builds/{BUILD}/libibckpt.so", state_dir=str(tmp_path / "state"))
    spec = oci.edit_spec(with_device(containerd_spec()), config, "c1")
    entry = stages.make_entry(config, "c1", os.getpid(), spec, "rdma device")
    assert entry["shim"] is True and entry["shim_build"] == BUILD
    plain = stages.make_entry(config, "c2", os.getpid(), with_device(containerd_spec()), "rdma device")
    assert "shim_build" not in plain, "no shim mounted: no build"


def test_the_staging_carries_the_recorded_build_and_refuses_a_bad_one(tmp_path: Path) -> None:
    manifest = {"root_pid": 1, "ranks": [], "runtime": "runc", "restore_args": "--tcp-established"}
    (tmp_path / TREE_MANIFEST).write_text(json.dumps({**manifest, SHIM_BUILD: BUILD}))
    assert restoring._from_tree_manifest(tmp_path) == ("--tcp-established", BUILD)
    (tmp_path / TREE_MANIFEST).write_text(json.dumps(manifest))
    assert restoring._from_tree_manifest(tmp_path) == ("--tcp-established", None)
    (tmp_path / TREE_MANIFEST).write_text(json.dumps({**manifest, SHIM_BUILD: "../../etc/passwd"}))
    with pytest.raises(restoring.RestoreError, match="is not a shim build"):
        restoring._from_tree_manifest(tmp_path)
