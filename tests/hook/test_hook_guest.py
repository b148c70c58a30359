"""The runtime handler and the hook with real runc and podman, in a Soft-RoCE guest.

The guest's / is the host's (read-only) under a tmpfs overlay, so the installer puts the hook,
the wrapper and the shim under /usr/local as it would on a node; /etc/ibckpt/node.json points
at the real runc. A registry serves /run/ibckpt/registry.sock. Containers run from a rootfs made
of the host's /usr (bind-mounted read-only): no image, nothing rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ibckpt_native.control import ShimControl
from ibckpt_node.hook import client

pytestmark = pytest.mark.guest

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "native" / "build" / "libibckpt.so"
FRONT = REPO / "native" / "build" / "ibckpt-front"  # the entry points, as the agent installs them
HOOKS_D = REPO / "runtime-hook" / "hooks.d"
STATE = Path("/run/ibckpt")
REGISTRY = STATE / "registry.sock"
WRAPPER = "/usr/local/bin/ibckpt-runc"
UVERBS = "/dev/infiniband/uverbs0"
PODMAN = [
    "podman",
    "--cgroup-manager",
    "cgroupfs",
    "--events-backend",
    "file",
    "--root",
    "/tmp/podman/root",
    "--runroot",
    "/tmp/podman/run",
    "--storage-driver",
    "vfs",
    "--hooks-dir",
    str(HOOKS_D),
]


def sh(*cmd: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def wait_for(what: str, predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def make_rootfs(where: Path) -> Path:
    """A container root: the host's /usr comes in as a read-only bind mount at run time."""
    rootfs = where / "rootfs"
    for d in ("proc", "dev", "sys", "tmp", "etc", "usr", "run"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        (rootfs / link).symlink_to(f"usr/{link}")
    sh("cp", "-r", "/etc/libibverbs.d", "/etc/ld.so.cache", "/etc/passwd", "/etc/group", str(rootfs / "etc"))
    return rootfs


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Cgroups, the node install, a registry; yields a directory with a rootfs in it."""
    sh("sh", str(Path(__file__).with_name("guest-cgroups.sh")))
    config = {"runc": "/usr/sbin/runc", "shim": "/usr/local/lib/ibckpt/libibckpt.so"}
    install = [sys.executable, "-m", "ibckpt_node.hook.install", "--shim", str(SHIM), "--front", str(FRONT)]
    sh(*install, "--config", json.dumps(config))
    registry = subprocess.Popen(
        [sys.executable, "-m", "ibckpt_node.registry", "serve", "--state-dir", str(STATE)],
        stdout=subprocess.DEVNULL,
        stderr=open(STATE.parent / "registry.log", "w"),  # noqa: SIM115 - lives as long as the registry
    )
    try:
        wait_for("the registry socket", REGISTRY.exists, 120)
        where = tmp_path_factory.mktemp("ct")
        make_rootfs(where)
        yield where
    finally:
        registry.terminate()
        registry.wait(30)


def entries() -> list[dict[str, Any]]:
    return client.list_entries(str(REGISTRY))


def hello(path: str) -> dict[str, Any]:
    """The shim's answer to `hello` on its control socket."""
    return ShimControl(path, timeout=30).command("hello")


def maps_have_shim(pid: int) -> bool:
    return "libibckpt.so" in Path(f"/proc/{pid}/maps").read_text()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def podman_run(rootfs: Path, options: list[str], command: list[str], runtime: str = WRAPPER) -> str:
    cmd = [*PODMAN, "--runtime", runtime, "run", "-d", "--network", "host", "-v", "/usr:/usr:ro", *options]
    return sh(*cmd, "--rootfs", str(rootfs), *command, timeout=300).stdout.strip()


def bundle_spec(cid: str) -> dict[str, Any]:
    """The config.json podman wrote (and the wrapper edited) for a container."""
    path = Path(f"/tmp/podman/root/vfs-containers/{cid}/userdata/config.json")
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec


def test_podman_runs_an_unmodified_verbs_program_under_the_shim(node: Path) -> None:
    """ibv_rc_pingpong loopback in a container: preloaded, registered, control socket answers."""
    script = (
        "ibv_rc_pingpong -g 1 -n 200 -p 18515 > /tmp/server.out 2>&1 & sleep 2; "
        "ibv_rc_pingpong -g 1 -n 200 -p 18515 127.0.0.1 > /tmp/client.out 2>&1 && wait $! && "
        "grep -q 'iters in' /tmp/client.out && grep -q 'iters in' /tmp/server.out && echo PINGPONG-OK; "
        "exec ibv_rc_pingpong -g 1 -p 18516"
    )
    cid = podman_run(node / "rootfs", ["--device", UVERBS], ["/bin/sh", "-c", script])
    try:
        logs = wait_for(
            "the ping-pong inside the container",
            lambda: (out := sh(*PODMAN, "logs", cid, check=False).stdout) and "PINGPONG-OK" in out and out,
            240,
        )
        assert "PINGPONG-OK" in logs
        (entry,) = wait_for("the registration", lambda: [e for e in entries() if e["container_id"] == cid])
        pid = entry["pid"]
        assert entry["shim"] is True and entry["reason"] == f"RDMA device {UVERBS}"
        assert entry["control_socket"] == f"/run/ibckpt/containers/{cid}/ctl/1.sock"
        # pid 1 of the container exec'd the last server, which opened the device under the shim
        wait_for("the shim's control socket", lambda: os.path.exists(entry["control_socket"]), 120)
        assert maps_have_shim(pid)
        env = environ(pid)
        assert env["LD_PRELOAD"] == "/run/ibckpt/lib/libibckpt.so"
        assert env["IBCKPT_COORD"] == "unix:/run/ibckpt/coord/coord.sock"
        assert hello(entry["control_socket"])["pid"] == 1
        # the earlier server and client each had their own socket (%p), removed as they exited: only the
        # live process's is left (a stale one would stand in the way of a checkpoint, issue 30)
        socks = sorted(os.listdir(f"/run/ibckpt/containers/{cid}/ctl"))
        assert socks == ["1.sock"], socks
        # podman put the hook in from hooks.d; the wrapper did not add it a second time (podman
        # runs poststop hooks itself, so config.json has none: the wrapper must not add one either)
        hooks = bundle_spec(cid)["hooks"]
        assert [h["path"] for h in hooks["createRuntime"]].count("/usr/local/bin/ibckpt-hook") == 1, hooks
        assert not hooks.get("poststop"), hooks
    finally:
        sh(*PODMAN, "rm", "-f", cid, check=False, timeout=300)
    wait_for("the deregistration at poststop", lambda: all(e["container_id"] != cid for e in entries()), 120)
    assert not Path(f"/run/ibckpt/containers/{cid}").exists()


def test_podman_leaves_a_container_without_rdma_alone(node: Path) -> None:
    cid = podman_run(node / "rootfs", [], ["/bin/sh", "-c", "sleep 600"])
    try:
        pid = int(sh(*PODMAN, "inspect", "--format", "{{.State.Pid}}", cid).stdout)
        assert "LD_PRELOAD" not in environ(pid)
        assert not maps_have_shim(pid)
        time.sleep(1)
        assert all(e["container_id"] != cid for e in entries())
        assert not Path(f"/run/ibckpt/containers/{cid}").exists()
        spec = bundle_spec(cid)
        assert not any(m["destination"].startswith("/run/ibckpt") for m in spec["mounts"])
        assert not any(e.startswith("LD_PRELOAD=") for e in spec["process"]["env"])
    finally:
        sh(*PODMAN, "rm", "-f", cid, check=False, timeout=300)


def test_podman_hooks_d_alone_registers_an_rdma_container_without_the_shim(node: Path) -> None:
    """Without the wrapper (podman's own runc) the hook still registers, and says it cannot preload."""
    cid = podman_run(
        node / "rootfs", ["--device", UVERBS], ["/bin/sh", "-c", "sleep 600"], runtime="/usr/sbin/runc"
    )
    try:
        (entry,) = wait_for("the registration", lambda: [e for e in entries() if e["container_id"] == cid])
        assert entry["shim"] is False and entry["control_socket"] == ""
        assert "LD_PRELOAD" not in environ(entry["pid"])
        assert "runs without the shim" in (STATE / "hook.log").read_text()
    finally:
        sh(*PODMAN, "rm", "-f", cid, check=False, timeout=300)
    wait_for("the deregistration", lambda: all(e["container_id"] != cid for e in entries()), 120)


CRI_ANNOTATIONS = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.container-name": "trainer",
    "io.kubernetes.cri.sandbox-name": "job-0",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-uid": "0b9e2d1c-1111-4222-8333-444455556666",
}


def runc_bundle(node: Path, name: str, args: list[str], annotations: dict[str, str]) -> Path:
    """A bundle as containerd would hand it to runc: `runc spec`, our rootfs, the RDMA device."""
    bundle = node / name
    bundle.mkdir()
    sh("runc", "spec", "--bundle", str(bundle))
    spec = json.loads((bundle / "config.json").read_text())
    dev = os.stat(UVERBS).st_rdev
    major, minor = os.major(dev), os.minor(dev)
    spec["root"] = {"path": str(node / "rootfs"), "readonly": False}
    spec["process"].update(terminal=False, args=args)
    # not rbind: CRIU cannot dump the guest's submount of /usr/lib/modules
    usr = {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["bind", "ro"]}
    spec["mounts"].append(usr)
    spec["linux"]["devices"] = [
        {"path": UVERBS, "type": "c", "major": major, "minor": minor, "fileMode": 0o666}
    ]
    spec["linux"]["resources"]["devices"].append(
        {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
    )
    spec["annotations"] = annotations
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def test_runc_through_the_wrapper_edits_create_and_passes_everything_else(node: Path) -> None:
    """ibckpt-runc create/start/state/kill/delete on a bundle, as containerd's runc shim calls it."""
    bundle = runc_bundle(
        node, "b-runc", ["/usr/bin/ibv_rc_pingpong", "-g", "1", "-p", "18517"], CRI_ANNOTATIONS
    )
    before = json.loads((bundle / "config.json").read_text())
    cid = "rdma-runc-1"
    glob = ["--root", "/run/runc-test", "--log", str(node / "runc-log.json"), "--log-format", "json"]
    out = open(node / "ct-out.txt", "w")  # noqa: SIM115 - the container keeps it
    create = [WRAPPER, *glob, "create", "--bundle", str(bundle), "--pid-file", str(node / "pid"), cid]
    done = subprocess.run(create, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=300)
    assert done.returncode == 0, (node / "ct-out.txt").read_text()
    try:
        pid = int((node / "pid").read_text())
        edited = json.loads((bundle / "config.json").read_text())
        env = dict(e.split("=", 1) for e in edited["process"]["env"])
        assert env["LD_PRELOAD"] == "/run/ibckpt/lib/libibckpt.so"
        assert [m["destination"] for m in edited["mounts"]][-3:] == [
            "/run/ibckpt/lib/libibckpt.so",
            "/run/ibckpt/ctl",
            "/run/ibckpt/coord",
        ]
        # the container's own coordinator directory, made by the wrapper: no other container sees it
        assert edited["mounts"][-1]["source"] == f"/run/ibckpt/containers/{cid}/coord"
        assert os.path.isdir(f"/run/ibckpt/containers/{cid}/coord")
        assert edited["mounts"][: len(before["mounts"])] == before["mounts"]
        assert [h["path"] for h in edited["hooks"]["createRuntime"]] == ["/usr/local/bin/ibckpt-hook"]
        assert [h["path"] for h in edited["hooks"]["poststop"]] == ["/usr/local/bin/ibckpt-hook"]
        # the createRuntime hook registered it during create, with the pod's identity
        (entry,) = [e for e in entries() if e["container_id"] == cid]
        assert (entry["pid"], entry["namespace"], entry["pod"], entry["container"], entry["shim"]) == (
            pid,
            "ml",
            "job-0",
            "trainer",
            True,
        )

        def state() -> dict[str, Any]:
            # the wrapper's answer between two of runc's: equal when the container did not change
            # meanwhile (after a kill it may stop between two reads)
            for _ in range(5):
                before = json.loads(sh("runc", *glob, "state", cid).stdout)
                mine: dict[str, Any] = json.loads(sh(WRAPPER, *glob, "state", cid).stdout)
                after = json.loads(sh("runc", *glob, "state", cid).stdout)
                if before == after:
                    assert mine == after, "state must be runc's own answer"
                    return mine
            raise AssertionError("the container's state changed between every two reads")

        assert (state()["status"], state()["pid"]) == ("created", pid)
        sh(WRAPPER, *glob, "start", cid)
        assert state()["status"] == "running"
        wait_for("the control socket", lambda: os.path.exists(entry["control_socket"]), 120)
        assert hello(entry["control_socket"])["pid"] == 1
        assert maps_have_shim(pid)
        assert sh(WRAPPER, "--version").stdout == sh("runc", "--version").stdout
        sh(WRAPPER, *glob, "kill", cid, "KILL")
        wait_for("the container to stop", lambda: state()["status"] == "stopped", 60)
        sh(WRAPPER, *glob, "delete", cid)
        assert sh("runc", *glob, "state", cid, check=False).returncode != 0
        # poststop (run by runc at delete) deregistered it and removed its directory
        assert all(e["container_id"] != cid for e in entries())
        assert not Path(f"/run/ibckpt/containers/{cid}").exists()
    finally:
        sh("runc", *glob, "delete", "--force", cid, check=False)
        out.close()


def test_runc_through_the_wrapper_leaves_a_plain_bundle_alone(node: Path) -> None:
    bundle = runc_bundle(node, "b-plain", ["/bin/true"], {})
    spec = json.loads((bundle / "config.json").read_text())
    spec["linux"]["devices"] = []
    (bundle / "config.json").write_text(json.dumps(spec))
    before = (bundle / "config.json").read_bytes()
    done = sh(WRAPPER, "--root", "/run/runc-test", "run", "--bundle", str(bundle), "plain-1")
    assert done.returncode == 0
    assert (bundle / "config.json").read_bytes() == before
    assert not Path("/run/ibckpt/containers/plain-1").exists()


def create_with_pipes(argv: list[str]) -> tuple[subprocess.CompletedProcess[bytes], int]:
    """Run a create as containerd's shim does: the container's stdio are pipes the caller keeps."""
    read_end, write_end = os.pipe()
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end, timeout=300)
    finally:
        os.close(write_end)
    return done, read_end


def test_a_staged_restore_runs_through_the_wrapper_and_a_forged_one_is_refused(node: Path) -> None:
    """runc checkpoint a container, stage its images as the agent would, create a new container
    through ibckpt-runc with the restore annotation: it continues where it was dumped."""
    out = node / "out"
    out.mkdir()
    # No exec in the loop: a `sleep` exec'd from the guest's 9p /usr waited in D state under load, and
    # CRIU cannot freeze a task in D state.
    count_up = (
        "import itertools, time\n"
        "for i in itertools.count(1):\n"
        "    open('/out/count', 'w').write(str(i))\n"
        "    time.sleep(0.1)"
    )
    counter = ["/usr/bin/python3", "-c", count_up]
    annotations = CRI_ANNOTATIONS | {"ibckpt.io/enabled": "true"}
    glob = ["--root", "/run/runc-restore", "--log", str(node / "restore-log.json"), "--log-format", "json"]

    def bundle(name: str, ann: dict[str, str]) -> Path:
        b = runc_bundle(node, name, counter, ann)
        spec = json.loads((b / "config.json").read_text())
        spec["mounts"].append(
            {"destination": "/out", "type": "bind", "source": str(out), "options": ["rbind", "rw"]}
        )
        (b / "config.json").write_text(json.dumps(spec))
        return b

    def count() -> int:
        return int((out / "count").read_text() or "0")

    first = bundle("b-ckpt", annotations)
    done, pipe_a = create_with_pipes([WRAPPER, *glob, "create", "--bundle", str(first), "ckpt-a"])
    assert done.returncode == 0, (node / "restore-log.json").read_text()
    sh(WRAPPER, *glob, "start", "ckpt-a")
    wait_for("the counter", lambda: (out / "count").exists() and count() > 5, 120)
    images = node / "images"
    dump = subprocess.run(
        ["runc", *glob, "checkpoint", "--image-path", str(images), "ckpt-a"], capture_output=True, text=True
    )
    if dump.returncode:
        log = (images / "dump.log").read_text() if (images / "dump.log").exists() else ""
        errors = "\n".join(line for line in log.splitlines() if "Error" in line)
        raise AssertionError(f"runc checkpoint: {dump.stderr}\n{errors}")
    dumped = count()
    sh(WRAPPER, *glob, "delete", "--force", "ckpt-a")
    time.sleep(1)
    assert count() == dumped, "the checkpointed container must be gone"

    # the agent's staging: root's, for this pod (namespace, name, uid) and container
    uid = CRI_ANNOTATIONS["io.kubernetes.cri.sandbox-uid"]
    staged = STATE / "restore" / "ml" / "job-0" / "trainer"
    staged.mkdir(parents=True, mode=0o700)
    for level in (staged.parents[1], staged.parent):
        level.chmod(0o700)
    shutil.move(images, staged / "images")
    (staged / "images").chmod(0o700)
    (staged / "staged.json").write_text(
        json.dumps(
            {
                "checkpoint": "ml/ckpt-1",
                "namespace": "ml",
                "pod": "job-0",
                "pod_uid": uid,
                "container": "trainer",
            }
        )
    )

    # a forged annotation (another namespace's checkpoint) is refused before runc runs
    forged = bundle("b-forged", annotations | {"ibckpt.io/restore-from": "other/ckpt-1"})
    done, pipe_f = create_with_pipes([WRAPPER, *glob, "create", "--bundle", str(forged), "forged-1"])
    os.close(pipe_f)
    assert done.returncode == 1
    assert "belongs to namespace 'other', the pod is in 'ml'" in (node / "restore-log.json").read_text()
    assert sh("runc", *glob, "state", "forged-1", check=False).returncode != 0

    second = bundle("b-restore", annotations | {"ibckpt.io/restore-from": "ml/ckpt-1"})
    pid_file = node / "restored.pid"
    create = [WRAPPER, *glob, "create", "--bundle", str(second), "--pid-file", str(pid_file), "ckpt-b"]
    done, pipe_b = create_with_pipes(create)
    try:
        assert done.returncode == 0, (node / "restore-log.json").read_text()
        state = json.loads(sh("runc", *glob, "state", "ckpt-b").stdout)
        assert state["status"] == "running" and state["pid"] == int(pid_file.read_text())
        sh(WRAPPER, *glob, "start", "ckpt-b")  # answered by the wrapper: it already runs
        wait_for("the restored counter", lambda: count() > dumped + 3, 120)
        assert maps_have_shim(state["pid"]), "restored with the shim mapped, from the same path"
        (entry,) = [e for e in entries() if e["container_id"] == "ckpt-b"]
        assert entry["pid"] == state["pid"]
    finally:
        sh("runc", *glob, "delete", "--force", "ckpt-b", check=False)
        os.close(pipe_a)
        os.close(pipe_b)
