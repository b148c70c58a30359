"""Host unit tests: a restore annotation is honoured only for images the agent staged for this pod."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node.hook import oci, restore, runc

UID = "0b9e2d1c-1111-4222-8333-444455556666"


def stage(config: oci.NodeConfig, **over: str) -> Path:
    """What the agent leaves for ml/job-0's container `trainer` (root's, as the agent is)."""
    where = Path(config.restore_dir("ml", "job-0", "trainer"))
    (where / "images").mkdir(parents=True)
    staged = {
        "checkpoint": "ml/ckpt-7",
        "namespace": "ml",
        "pod": "job-0",
        "pod_uid": UID,
        "container": "trainer",
    }
    staged.update(over)
    for p in (where.parents[2], where.parents[1], where.parent, where, where / "images"):
        p.chmod(0o700)
    # Written last and renamed into place, as the agent does: a waiting check never reads half a file.
    (where / "staged.json.partial").write_text(json.dumps(staged))
    (where / "staged.json.partial").rename(where / "staged.json")
    return where


@pytest.fixture
def config(tmp_path: Path) -> oci.NodeConfig:
    return oci.NodeConfig(state_dir=str(tmp_path / "state"), restore_wait_s=0.0)


def restoring(value: str = "ml/ckpt-7", **ann: str) -> dict[str, Any]:
    return with_device(containerd_spec(**{oci.ANN_RESTORE: value}, **ann))


def test_staged_images_for_this_pod_are_used(config: oci.NodeConfig) -> None:
    where = stage(config, restore_args="--tcp-established")
    assert restore.check(config, restoring()) == (str(where / "images"), "--tcp-established", None)


def test_another_namespaces_checkpoint_is_refused(config: oci.NodeConfig) -> None:
    stage(config)
    with pytest.raises(oci.Refused, match=r"belongs to namespace 'other', the pod is in 'ml'"):
        restore.check(config, restoring("other/ckpt-7"))


def test_a_forged_annotation_with_nothing_staged_is_refused(config: oci.NodeConfig) -> None:
    with pytest.raises(oci.Refused, match="staged no images for it on this node"):
        restore.check(config, restoring())


def test_a_create_waits_for_the_agent_to_stage(config: oci.NodeConfig) -> None:
    import threading

    config.restore_wait_s = 20.0
    late = threading.Timer(1.0, stage, (config,))
    late.start()
    started = time.monotonic()
    where, _, _ = restore.check(config, restoring())
    assert where.endswith("/images") and 0.9 < time.monotonic() - started < 15
    late.join()
    config.restore_wait_s = 0.5
    started = time.monotonic()
    with pytest.raises(oci.Refused, match=r"staged no images for it on this node within 0.5s"):
        restore.check(config, restoring("ml/ckpt-7", **{"io.kubernetes.cri.sandbox-name": "job-1"}))
    assert time.monotonic() - started >= 0.5


def test_images_staged_before_the_pod_existed_serve_the_pod_of_that_name(config: oci.NodeConfig) -> None:
    """The operator has the images staged, then creates the pods: any uid, but only that name."""
    where = stage(config, pod_uid="")
    other_uid = {"io.kubernetes.cri.sandbox-uid": "99999999-0000-4000-8000-000000000000"}
    assert restore.check(config, restoring(**other_uid)) == (str(where / "images"), "", None)
    with pytest.raises(oci.Refused, match="staged no images for it"):
        restore.check(config, restoring(**{"io.kubernetes.cri.sandbox-name": "job-1"}))
    with pytest.raises(oci.Refused, match="bad container id"):
        restore.check(config, restoring(**{"io.kubernetes.cri.sandbox-name": ".."}))


def test_images_staged_for_another_pod_uid_are_refused(config: oci.NodeConfig) -> None:
    stage(config)  # staged for UID: the pod existed when the agent was asked
    other_uid = {"io.kubernetes.cri.sandbox-uid": "99999999-0000-4000-8000-000000000000"}
    with pytest.raises(oci.Refused, match=r"staged images are for another restore \(pod_uid="):
        restore.check(config, restoring(**other_uid))


def test_images_staged_for_another_restore_are_refused(config: oci.NodeConfig) -> None:
    stage(config, checkpoint="ml/ckpt-6")
    with pytest.raises(oci.Refused, match="staged images are for another restore"):
        restore.check(config, restoring())


def test_images_someone_else_can_write_are_refused(config: oci.NodeConfig) -> None:
    where = stage(config)
    (where / "staged.json").chmod(0o666)
    with pytest.raises(oci.Refused, match="not root's alone"):
        restore.check(config, restoring())
    (where / "staged.json").chmod(0o600)
    where.parent.chmod(0o777)  # the pod's directory: whoever writes it could swap the container's
    with pytest.raises(oci.Refused, match="not root's alone"):
        restore.check(config, restoring())
    where.parent.chmod(0o700)
    os.chown(where / "images", 1000, 1000)
    with pytest.raises(oci.Refused, match="not root's alone"):
        restore.check(config, restoring())


def test_restore_args_outside_the_allowlist_are_refused(config: oci.NodeConfig) -> None:
    stage(config, restore_args="--action-script /tmp/evil")
    with pytest.raises(oci.Refused, match="not allowed"):
        restore.check(config, restoring())


def test_malformed_and_anonymous_are_refused(config: oci.NodeConfig) -> None:
    with pytest.raises(oci.Refused, match="expected NAMESPACE/CHECKPOINT"):
        restore.check(config, restoring("ckpt-7"))
    anonymous = restoring()
    del anonymous["annotations"]["io.kubernetes.cri.sandbox-uid"]
    with pytest.raises(oci.Refused, match="no pod identity"):
        restore.check(config, anonymous)


def staged_wrapper(tmp_path: Path, runc_script: str) -> tuple[Path, Path, dict[str, str]]:
    """A node config whose runc is `runc_script` (sh), images staged for restoring()'s container, and its
    bundle: (staged dir, bundle, the wrapper's environment)."""
    fake = tmp_path / "runc"
    fake.write_text(f"#!/bin/sh\n{runc_script}\n")
    fake.chmod(0o755)
    shim = tmp_path / "libibckpt.so"
    shim.write_bytes(b"\x7fELF")
    node = {"runc": str(fake), "shim": str(shim), "state_dir": str(tmp_path / "state"), "restore_wait_s": 0}
    (tmp_path / "node.json").write_text(json.dumps(node))
    where = stage(oci.load_config({"IBCKPT_NODE_CONFIG": str(tmp_path / "node.json")}))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(restoring()))
    return where, bundle, {"PATH": os.environ["PATH"], "IBCKPT_NODE_CONFIG": str(tmp_path / "node.json")}


def test_the_wrapper_turns_create_into_restore_and_answers_start(tmp_path: Path) -> None:
    import subprocess

    where, bundle, env = staged_wrapper(tmp_path, 'for a in "$@"; do printf "%s\\n" "$a"; done > "$RECORD"')
    env["RECORD"] = str(tmp_path / "argv")

    def wrap(*argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "ibckpt_node.hook.runc", *argv]
        return subprocess.run(cmd, env=env, capture_output=True, text=True)

    done = wrap("--root", "/r", "create", "--bundle", str(bundle), "--pid-file", "/p", "c9")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == [
        "--root",
        "/r",
        "restore",
        "--detach",
        "--image-path",
        str(where / "images"),
        "--bundle",
        str(bundle),
        "--pid-file",
        "/p",
        "c9",
    ]
    assert "LD_PRELOAD=/run/ibckpt/lib/libibckpt.so" in (bundle / "config.json").read_text()
    (tmp_path / "argv").unlink()
    done = wrap("--root", "/r", "start", "c9")
    assert done.returncode == 0 and not (tmp_path / "argv").exists(), (
        "start of a restored container is answered"
    )
    done = wrap("--root", "/r", "start", "c9")
    assert (tmp_path / "argv").read_text().splitlines() == ["--root", "/r", "start", "c9"], "only once"

    # the same annotation on another pod's container: refused, runc never runs
    (tmp_path / "argv").unlink()
    other = restoring()
    other["annotations"]["io.kubernetes.cri.sandbox-uid"] = "99999999-0000-4000-8000-000000000000"
    (bundle / "config.json").write_text(json.dumps(other))
    log = tmp_path / "log.json"
    done = wrap("--log", str(log), "--log-format", "json", "create", "--bundle", str(bundle), "c10")
    assert done.returncode == 1
    assert "staged images are for another restore" in json.loads(log.read_text())["msg"]
    assert not (tmp_path / "argv").exists()

    # the pod's sandbox carries the same annotation (containerd passes pod annotations to it): untouched
    sandbox = containerd_spec(**{oci.ANN_RESTORE: "ml/ckpt-7", "io.kubernetes.cri.container-type": "sandbox"})
    (bundle / "config.json").write_text(json.dumps(sandbox))
    done = wrap("--root", "/r", "create", "--bundle", str(bundle), "pause1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == [
        "--root",
        "/r",
        "create",
        "--bundle",
        str(bundle),
        "pause1",
    ]
    assert json.loads((bundle / "config.json").read_text()) == sandbox
    assert runc.RESTORED_MARK == "restored"


def test_a_restore_mounts_the_shim_build_its_checkpoint_recorded(tmp_path: Path) -> None:
    """The checkpoint's processes mapped an older build: the restored container mounts that one, kept
    beside the node's current build, and a node without it refuses, naming the build."""
    import hashlib
    import subprocess

    older, current = b"\x7fELF before the upgrade", b"\x7fELF after the upgrade"
    builds = tmp_path / "lib" / "builds"
    paths = {}
    for data in (older, current):
        digest = hashlib.sha256(data).hexdigest()
        (builds / digest).mkdir(parents=True)
        (builds / digest / "libibckpt.so").write_bytes(data)
        paths[data] = (digest, str(builds / digest / "libibckpt.so"))
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    node: dict[str, object] = {
        "runc": str(fake),
        "shim": paths[current][1],
        "state_dir": str(tmp_path / "state"),
    }
    node["restore_wait_s"] = 0
    (tmp_path / "node.json").write_text(json.dumps(node))
    env = {"PATH": os.environ["PATH"], "IBCKPT_NODE_CONFIG": str(tmp_path / "node.json")}
    env["PYTHONPATH"] = str(Path(runc.__file__).parents[2])  # this checkout's wrapper
    where = stage(oci.load_config(env), shim_build=paths[older][0])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(restoring()))
    cmd = [sys.executable, "-m", "ibckpt_node.hook.runc", "create", "--bundle", str(bundle), "c9"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert oci.shim_source(json.loads((bundle / "config.json").read_text())) == paths[older][1]

    # the node no longer keeps that build: refused before runc runs, the build named
    (bundle / "config.json").write_text(json.dumps(restoring()))
    os.unlink(paths[older][1])
    with pytest.raises(
        oci.Refused, match=f"mapped shim build {paths[older][0][:12]}, which this node does not"
    ):
        restore.check(oci.load_config(env), restoring())
    # a staging from before builds were recorded names none: the current build, as before
    import shutil

    shutil.rmtree(where)
    stage(oci.load_config(env))
    assert restore.check(oci.load_config(env), restoring())[2] is None


def test_the_rootfs_diff_is_applied_inside_the_new_root(tmp_path: Path) -> None:
    """Files the container wrote come back, files it deleted (whiteouts) go (hostile archives:
    test_unpack.py)."""
    import io
    import tarfile

    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "debian_version").write_text("12\n")
    (rootfs / "old").mkdir()
    (rootfs / "old" / "inside").write_text("x")
    images = tmp_path / "images"
    images.mkdir()
    with tarfile.open(images / restore.ROOTFS_DIFF, "w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, data: bytes = b"", **fields: Any) -> None:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data)
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("./tmp", tarfile.DIRTYPE, mode=0o1777)
        add("./tmp/session/ready", tarfile.REGTYPE, b"written before the cut", mode=0o640)
        add("./etc/debian_version", tarfile.CHRTYPE, devmajor=0, devminor=0)
        add("./old", tarfile.CHRTYPE, devmajor=0, devminor=0)
        add("./evil", tarfile.SYMTYPE, linkname="/")
    restore.apply_rootfs_diff(str(images), str(rootfs))
    assert (rootfs / "tmp" / "session" / "ready").read_text() == "written before the cut"
    assert (rootfs / "tmp" / "session" / "ready").stat().st_mode & 0o777 == 0o640
    assert not (rootfs / "etc" / "debian_version").exists() and (rootfs / "etc").is_dir()
    assert not (rootfs / "old").exists()
    assert os.readlink(rootfs / "evil") == "/"  # made as it was, never followed
    # no archive (a checkpoint without a writable layer): nothing to do
    restore.apply_rootfs_diff(str(tmp_path / "none"), str(rootfs))


def shm_spec(source: str, kind: str = "bind") -> dict[str, Any]:
    mount = {"destination": "/dev/shm", "type": kind, "source": source, "options": ["rbind", "rw"]}
    return {"mounts": [mount]}


def test_where_a_containers_dev_shm_comes_from() -> None:
    sandbox = "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/abc/shm"
    assert oci.shm_source(shm_spec(sandbox)) == sandbox
    assert oci.shm_source(shm_spec("/dev/shm")) is None  # hostIPC: the node's own, never carried
    assert oci.shm_source(shm_spec("shm", "tmpfs")) is None  # a tmpfs of its own: in the process image
    assert oci.shm_source({"mounts": [{"destination": "/tmp", "type": "bind", "source": "/x"}]}) is None


def test_dev_shm_files_travel_from_the_old_sandbox_into_the_new_one(tmp_path: Path) -> None:
    """The agent archives the sandbox's /dev/shm after the dump; the wrapper unpacks it, confined, into
    the new sandbox's before `runc restore` (a link in it is archived as a link and stays inside)."""
    from ibckpt_node import container_runtime

    old, new, images = tmp_path / "old-shm", tmp_path / "new-shm", tmp_path / "images"
    for d in (old, new, images):
        d.mkdir()
    (old / "ompi.seg").write_bytes(b"\x01" * 4096)
    (old / "ompi.seg").chmod(0o600)
    (old / "escape").symlink_to("/")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(shm_spec(str(old))))
    container = container_runtime.RuntimeContainer("c1", "runc", "", str(bundle))
    assert container_runtime.shm_dir(container) == str(old)
    assert container_runtime.save_shm(str(old), images) > 4096
    restore.apply_shm(str(images), shm_spec(str(new)))
    assert (new / "ompi.seg").read_bytes() == b"\x01" * 4096
    assert (new / "ompi.seg").stat().st_mode & 0o777 == 0o600
    assert os.readlink(new / "escape") == "/"
    # an empty /dev/shm leaves nothing in the images, and nothing is applied
    empty = tmp_path / "empty"
    empty.mkdir()
    assert container_runtime.save_shm(str(empty), tmp_path) == 0
    assert not (tmp_path / oci.SHM_ARCHIVE).exists()
    # files to carry and no /dev/shm of its own to put them in: refused, with the reason
    with pytest.raises(oci.Refused, match="no /dev/shm of its own"):
        restore.apply_shm(str(images), shm_spec("/dev/shm"))


def test_the_unpack_needs_nothing_from_the_root_it_writes_into(tmp_path: Path) -> None:
    """The wrapper is a fresh interpreter: it unpacks into a bare /dev/shm (no Python, no libraries)
    without chrooting there, so nothing it imports or loads could come from the container's files
    (planted ones, under every Python here: test_unpack_interpreters.py)."""
    import subprocess
    import tarfile

    images, target = tmp_path / "images", tmp_path / "bare"  # no Python, no libraries inside
    images.mkdir()
    target.mkdir()
    with tarfile.open(images / oci.SHM_ARCHIVE, "w") as tar:
        info = tarfile.TarInfo("./seg")
        info.size = 2
        tar.addfile(info, __import__("io").BytesIO(b"ok"))
    code = (
        "import sys, json, os\n"
        "def never(*args):\n"
        "    raise AssertionError('the unpack chroots or forks')\n"
        "os.chroot = os.fork = os.execv = never\n"
        "from ibckpt_node.hook import restore\n"
        "restore.apply_shm(sys.argv[1], json.loads(sys.argv[2]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(images), json.dumps(shm_spec(str(target)))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert (target / "seg").read_bytes() == b"ok"


def test_a_failed_restore_reports_criu_s_own_error_where_containerd_reads_it(tmp_path: Path) -> None:
    import subprocess

    # runc restore fails as it does: its own words are "criu failed: type NOTIFY", CRIU's are in restore.log
    _, bundle, env = staged_wrapper(
        tmp_path,
        'while [ "$1" != --image-path ]; do shift; done\n'
        'echo "(00.4) 1: Error (criu/sk-inet.c:1111): Can\'t connect inet socket back" >"$2/restore.log"\n'
        'echo "(00.5) Error (criu/cr-restore.c:2397): Restoring FAILED." >>"$2/restore.log"\n'
        'echo "criu failed: type NOTIFY errno 0" >&2; exit 1',
    )
    log = tmp_path / "log.json"
    argv = ["--log", str(log), "--log-format", "json", "create", "--bundle", str(bundle), "c11"]
    command = [sys.executable, "-m", "ibckpt_node.hook.runc", *argv]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 1
    last = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert "runc restore failed (status 1)" in last, last
    assert "Can't connect inet socket back" in last and "Restoring FAILED" in last, last
