"""The one place that checkpoints a container through its OCI runtime: `runc checkpoint`.

runc drives CRIU with what it knows of the container (its namespaces, its bind mounts as external
mounts, its cgroups), which a plain CRIU dump of the container's processes would not know. The runc
binary, its state root and the bundle are the ones the runtime wrapper recorded when containerd
created the container (hook/runc.py, `runtime.json`). They are the node's: the agent runs in a
container of its own, so runc runs in the node's mount namespace (pid 1's), as containerd would run
it. The image directory is a path the agent and the node share (the agent's host dir).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ibckpt_node import criu
from ibckpt_node.criu import CriuError, DumpOptions, DumpResult
from ibckpt_node.hook import oci

RUNTIME_RECORD = "runtime.json"  # written by hook/runc.py beside the container's control dir
ROOTFS_DIFF = "rootfs-diff.tar"  # what the container wrote to its own filesystem (hook/restore.py applies it)
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class RuntimeContainer:
    """A container as its runtime knows it."""

    container_id: str
    runc: str
    root: str  # runc's --root (containerd: /run/containerd/runc/<namespace>)
    bundle: str = ""  # the OCI bundle containerd gave runc (its config.json is the container's spec)

    @classmethod
    def recorded(cls, container_id: str, container_dir: Path) -> RuntimeContainer:
        """What the wrapper recorded at create; CriuError if it did not (not created through it)."""
        path = container_dir / RUNTIME_RECORD
        try:
            data = json.loads(path.read_text())
            return cls(container_id, str(data["runc"]), str(data["root"]), str(data.get("bundle") or ""))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CriuError(
                "checkpoint",
                container_id,
                f"no runtime record at {path} ({exc}): was the container created through ibckpt-runc?",
                "",
            ) from None


def in_node_mount_namespace() -> list[str]:
    """The prefix that runs a command in the node's mount namespace ([] when this is it)."""
    try:
        if os.readlink("/proc/self/ns/mnt") == os.readlink("/proc/1/ns/mnt"):
            return []
    except OSError:
        return []
    return ["nsenter", "--target", "1", "--mount", "--"]


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return f"(no log at {path})"


def checkpoint(
    container: RuntimeContainer,
    images: Path,
    options: DumpOptions,
    timeout_s: float,
    parent: Path | None = None,
    pre_dump_plugins: str | None = None,
) -> DumpResult:
    """`runc checkpoint` of the container into `images` (created, must be empty). With `parent` (a
    pre-dump of it), only the pages written since; with `pre_dump_plugins` (CRIU's plugin dir on the
    node), a pre-dump: the container goes on running (criu.py)."""
    action = "pre-dump" if pre_dump_plugins else "checkpoint"
    images.mkdir(parents=True, exist_ok=True)
    if any(images.iterdir()):
        raise CriuError(action, container.container_id, f"image dir {images} is not empty", "")
    args = [
        *in_node_mount_namespace(), container.runc, *(["--root", container.root] if container.root else []),
        "checkpoint", "--image-path", str(images), "--work-path", str(images),
    ]  # fmt: skip
    if pre_dump_plugins:
        args += ["--pre-dump", *options.restore_flags()]
    else:
        args += options.dump_flags()
    if parent is not None:
        args += ["--parent-path", criu.parent_arg(images, parent)]
    args.append(container.container_id)
    log = images / ("pre-dump.log" if pre_dump_plugins else "dump.log")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout_s, env=criu.plugins_env(pre_dump_plugins)
        )
    except subprocess.TimeoutExpired:
        raise CriuError(
            action,
            container.container_id,
            f"runc checkpoint timed out after {timeout_s:g}s (it was killed)",
            _tail(log),
        ) from None
    if proc.returncode != 0:
        detail = f"runc checkpoint exit status {proc.returncode}"
        if proc.stderr.strip():
            detail += f": {proc.stderr.strip()[-500:]}"
        raise CriuError(action, container.container_id, detail, _tail(log))
    return DumpResult(images, time.monotonic() - started)


def upper_dir(pid: int) -> str | None:
    """The host path of the overlay upper dir under the container's root (its writable layer), or
    None when the root is not an overlay (then nothing it wrote travels: the note in the report says so)."""
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] != "/":
                continue
            after = fields[fields.index("-") + 1 :]
            if after[0] != "overlay":
                return None
            for option in after[2].split(","):
                if option.startswith("upperdir="):
                    return option.removeprefix("upperdir=")
    return None


def save_rootfs_diff(upper: str | None, images: Path) -> int:
    """Archive the container's writable layer (`upper`: files it wrote, and whiteouts for files it
    deleted) into the images; the restoring wrapper applies it to the new container's root."""
    import tarfile

    if upper is None:
        return 0
    node_root = "/proc/1/root" if in_node_mount_namespace() else ""
    target = images / ROOTFS_DIFF
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(node_root + upper, arcname=".", recursive=True)
    return target.stat().st_size


def bundle_spec(container: RuntimeContainer) -> dict[str, object] | None:
    """The container's edited spec, read from its bundle on the node; None when it cannot be read."""
    if not container.bundle:
        return None
    node_root = "/proc/1/root" if in_node_mount_namespace() else ""
    try:
        spec = json.loads(Path(node_root + container.bundle, "config.json").read_text())
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def shm_dir(container: RuntimeContainer) -> str | None:
    """The node directory behind the container's /dev/shm (oci.shm_source), read from its bundle before
    the dump; None when there is none to carry."""
    spec = bundle_spec(container)
    return oci.shm_source(spec) if spec is not None else None


def shim_build(container: RuntimeContainer) -> str | None:
    """The shim build the container's processes map: the digest its mount's source names (the wrapper
    mounts a content-addressed build), or, for a container started before builds were kept, the digest
    of the file it mounts (never rewritten since). None: no shim mounted, or its file cannot be read."""
    import hashlib

    spec = bundle_spec(container)
    source = oci.shim_source(spec) if spec is not None else None
    if source is None:
        return None
    build = oci.build_of(source)
    if build is not None:
        return build
    try:
        with open(("/proc/1/root" if in_node_mount_namespace() else "") + source, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def save_shm(source: str | None, images: Path) -> int:
    """Archive the files of the container's /dev/shm into the images (the wrapper puts them into the new
    sandbox's before `runc restore`). Links are archived as links, never followed."""
    import tarfile

    if source is None:
        return 0
    path = ("/proc/1/root" if in_node_mount_namespace() else "") + source
    try:
        if not os.listdir(path):
            return 0
    except OSError:
        return 0
    target = images / oci.SHM_ARCHIVE
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(path, arcname=".", recursive=True)
    return target.stat().st_size


def restore_args(options: DumpOptions) -> str:
    """The runc restore options that match a checkpoint taken with `options` (staged.json's)."""
    return " ".join(options.restore_flags())


# What CRIU learns of the kernel on its first run (kerndat) it caches in /run/criu.kdat until the
# node reboots. Learning it took 3 s of a TCG guest's first dump, inside the ranks' gate.
KERNEL_FACTS_CHECK = ["criu", "check", "--feature", "mem_dirty_track"]


def warm_criu(timeout_s: float = 60.0) -> str:
    """Run the node's CRIU once, so that it caches its kernel facts before the first checkpoint needs
    them. The feature asked is the pre-dumps' (dirty-page tracking). Returns what CRIU said; raises
    CriuError if it could not run or said no."""
    args = in_node_mount_namespace() + KERNEL_FACTS_CHECK
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuError("check", "mem_dirty_track", f"criu did not run: {exc}", "") from None
    said = (done.stdout + done.stderr).strip()[-LOG_TAIL_CHARS:]
    if done.returncode != 0:
        raise CriuError("check", "mem_dirty_track", f"criu check exited {done.returncode}", said)
    return said
