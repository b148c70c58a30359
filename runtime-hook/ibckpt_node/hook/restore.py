"""Whether a `create` may become a restore, and from which images.

A pod annotation alone proves nothing: anybody who can create a pod can write one. A restore is
honoured only when the node agent (root) staged images for exactly this container:

    STATE_DIR/restore/NS/POD/CONTAINER/staged.json   {"checkpoint": "NS/NAME", "namespace": NS,
                                                       "pod": POD, "pod_uid": UID or "",
                                                       "container": NAME, "restore_args": "...",
                                                       "shim_build": SHA256 (absent: none recorded)}
    STATE_DIR/restore/NS/POD/CONTAINER/images/       what `runc checkpoint` wrote

and both are root's and writable by nobody else. The agent stages only for a RestoreJob the
operator admitted, so an annotation copied onto a pod of another name, or naming another
namespace's checkpoint, finds nothing. `shim_build` is the shim build the checkpoint's processes
mapped: the restored container mounts that one (runc.prepare), not the node's current build. The
operator has the images staged before it creates the pods (their uid does not exist yet:
staged.json's pod_uid is then empty); when the agent was asked
for pods that already existed, their uid must match too. The agent removes the staging when its
session ends, so it serves one restore.
"""

from __future__ import annotations

import json
import os
import stat
import time

from ibckpt_node.hook import oci
from ibckpt_node.hook.oci import Refused

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# runc restore options the agent may ask for (they must match how it dumped)
ALLOWED_RESTORE_ARGS = frozenset({"--tcp-established", "--ext-unix-sk", "--file-locks", "--shell-job"})


def _root_only(path: str, what: str) -> os.stat_result:
    st = os.lstat(path)
    if st.st_uid != 0 or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
        raise Refused(f"{what} {path} is not root's alone (owner {st.st_uid}, mode {st.st_mode & 0o7777:o})")
    return st


def check(config: oci.NodeConfig, spec: dict[str, Any]) -> tuple[str, str, str | None]:
    """(image dir, extra restore args, the shim file to mount or None: the current one) for this
    container, or Refused saying why not."""
    value = oci.annotations_of(spec).get(oci.ANN_RESTORE, "").strip()
    who = oci.identity(spec)
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise Refused(f"{oci.ANN_RESTORE}={value!r}: expected NAMESPACE/CHECKPOINT")
    if not (who.namespace and who.pod and who.pod_uid and who.container):
        raise Refused(
            f"{oci.ANN_RESTORE}={value}: the container carries no pod identity "
            "(namespace, pod, pod uid, container name), so no restore can be matched to it"
        )
    if namespace != who.namespace:
        raise Refused(
            f"refusing to restore pod {who.namespace}/{who.pod} from checkpoint {value}: "
            f"it belongs to namespace {namespace!r}, the pod is in {who.namespace!r}"
        )
    try:
        for name in (who.namespace, who.pod, who.pod_uid, who.container):
            oci.checked_id(name)
    except ValueError as exc:
        raise Refused(str(exc)) from None
    where = config.restore_dir(who.namespace, who.pod, who.container)
    staged_file = os.path.join(where, "staged.json")
    images = os.path.join(where, "images")
    # Normally staged before the pod exists; a restore asked for existing pods may still be staging.
    deadline = time.monotonic() + config.restore_wait_s
    while not os.path.exists(staged_file) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        for level in (os.path.dirname(os.path.dirname(where)), os.path.dirname(where), where):
            _root_only(level, "restore dir")  # a writable parent would let someone swap the dir
        _root_only(staged_file, "staged restore")
        _root_only(images, "image dir")
        with open(staged_file, encoding="utf-8") as f:
            staged = json.load(f)
    except FileNotFoundError:
        raise Refused(
            f"refusing to restore pod {who.namespace}/{who.pod} (uid {who.pod_uid}) container "
            f"{who.container} from {value}: the node agent staged no images for it on this node "
            f"within {config.restore_wait_s:g}s (a forged or stale restore annotation, or the agent has not "
            "staged them yet: the kubelet retries)"
        ) from None
    except ValueError as exc:
        raise Refused(f"{staged_file}: {exc}") from None
    want = {
        "checkpoint": value,
        "namespace": who.namespace,
        "pod": who.pod,
        "pod_uid": who.pod_uid,
        "container": who.container,
    }
    if not isinstance(staged, dict):
        raise Refused(f"{staged_file}: not an object")
    if staged.get("pod_uid") == "":
        del want["pod_uid"]  # staged before the pod existed: the pod of this name created since
    wrong = sorted(k for k, v in want.items() if staged.get(k) != v)
    if wrong:
        theirs = ", ".join(f"{k}={staged.get(k)!r}" for k in wrong)
        raise Refused(
            f"refusing to restore pod {who.namespace}/{who.pod} container {who.container} from {value}: "
            f"the staged images are for another restore ({theirs})"
        )
    extra = str(staged.get("restore_args", ""))
    bad = [a for a in extra.split() if a not in ALLOWED_RESTORE_ARGS]
    if bad:
        raise Refused(f"{staged_file}: restore_args {bad} not allowed")
    return (
        images,
        extra,
        _recorded_shim(config, staged, f"{who.namespace}/{who.pod} container {who.container}"),
    )


def _recorded_shim(config: oci.NodeConfig, staged: dict[str, Any], who: str) -> str | None:
    """The node file of the shim build the checkpoint's processes mapped (staged.json's `shim_build`);
    None for a checkpoint that recorded none (it restores with the current one, as before)."""
    build = staged.get("shim_build")
    if build is None:
        return None
    if not isinstance(build, str) or not oci.is_build_digest(build):
        raise Refused(f"restore of {who}: staged shim_build {build!r} is not a shim build")
    path = oci.build_path(config.shim, build)
    if not os.path.isfile(path):
        raise Refused(
            f"refusing to restore {who}: its processes mapped shim build {build[:12]}, which this node "
            f"does not keep ({path} is missing)"
        )
    return path


ROOTFS_DIFF = "rootfs-diff.tar"  # container_runtime.ROOTFS_DIFF (the agent's side)


RESTORE_LOG = "restore.log"  # runc restore's CRIU log, in the image dir (its default work path)


def criu_errors(images: str, lines: int = 6) -> str:
    """The last error lines of CRIU's restore log in `images` ("" if none): what explains a failed
    `runc restore`, which runc itself reports only as "criu failed: type NOTIFY errno 0"."""
    try:
        with open(os.path.join(images, RESTORE_LOG), encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return " | ".join(errors[-lines:])


def apply_rootfs_diff(images: str, rootfs: str) -> None:
    """Write what the checkpointed container had written to its own filesystem into the new
    container's root, and delete what it had deleted (overlay whiteouts: 0/0 character devices)."""
    _unpack_into(os.path.join(images, ROOTFS_DIFF), rootfs, "the checkpointed container's file changes")


def apply_shm(images: str, spec: dict[str, Any]) -> None:
    """Put the files the checkpointed container had in /dev/shm into the new container's /dev/shm (the
    new sandbox's tmpfs, outside the container: runc restores the mount as external, and a process
    whose open or mapped file there is missing cannot be restored)."""
    archive = os.path.join(images, oci.SHM_ARCHIVE)
    if not os.path.exists(archive):
        return
    target = oci.shm_source(spec)
    if target is None:
        raise Refused(
            f"the checkpointed container had files in {oci.SHM}, and the new one has no {oci.SHM} of its "
            "own to put them in (a pod sharing the node's IPC namespace?)"
        )
    _unpack_into(archive, target, f"the checkpointed container's {oci.SHM} files")


def _unpack_into(archive: str, root: str, what: str) -> None:
    """The archive comes from a user's container: it is unpacked by this process through a directory
    fd of `root`, never chrooted there and never through a link (unpack.py says why)."""
    if not os.path.exists(archive):
        return
    # Imported here: only a restore with files to carry needs tarfile (every container create
    # imports this module).
    from ibckpt_node.hook.unpack import Unpack

    Unpack(root, what).run(archive)
