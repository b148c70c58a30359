"""Host unit tests of ibckpt-runc: runc's argv, the edit on create, exact pass-through.

The real runc runs in the guest (test_hook_guest.py). Here a stand-in that records its argv takes
runc's place, which is enough to prove the wrapper hands every argument over untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node.hook import oci, runc

RECORDER = """#!/bin/sh
# stands in for runc: records its argv, one per line
for a in "$@"; do printf '%s\\n' "$a"; done > "$RECORD"
"""


def test_find_command_skips_global_flags() -> None:
    argv = [
        "--root",
        "/run/containerd/runc/k8s.io",
        "--log=/x/log.json",
        "--log-format",
        "json",
        "--systemd-cgroup",
        "-debug",
        "create",
        "--bundle",
        "/b",
        "id1",
    ]
    assert runc.find_command(argv) == 7
    assert runc.find_command(["state", "x"]) == 0
    assert runc.find_command(["--version"]) is None
    assert runc.find_command([]) is None
    assert runc.find_command(["--criu", "/usr/sbin/criu", "restore", "x"]) == 2


def test_create_args() -> None:
    args = runc.CreateArgs(
        ["--bundle", "/b", "--pid-file=/p", "--console-socket", "/c.sock", "--no-pivot", "cid"]
    )
    assert (args.bundle, args.container_id, args.value("pid-file")) == ("/b", "cid", "/p")
    assert runc.CreateArgs(["-b", "/b2", "x"]).bundle == "/b2"
    assert runc.CreateArgs(["x"]).bundle == os.getcwd()
    argv = runc.restore_argv(["--root", "/r"], args, "/img", "--tcp-established")
    assert argv == [
        "--root",
        "/r",
        "restore",
        "--detach",
        "--image-path",
        "/img",
        "--bundle",
        "/b",
        "--pid-file=/p",
        "--console-socket",
        "/c.sock",
        "--no-pivot",
        "--tcp-established",
        "cid",
    ]


def test_log_error_writes_runcs_json_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.json"
    runc.log_error(["--log", str(log), "--log-format", "json"], "no way")
    assert json.loads(log.read_text())["msg"] == "ibckpt-runc: no way"
    assert json.loads(log.read_text())["level"] == "error"
    assert "ibckpt-runc: no way" in capsys.readouterr().err


@pytest.fixture
def wrapper(tmp_path: Path) -> dict[str, Any]:
    """Runs ibckpt-runc as a process against the recorder, with a node config under tmp_path."""
    fake = tmp_path / "runc"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    shim = tmp_path / "libibckpt.so"
    shim.write_bytes(b"\x7fELF")
    state = tmp_path / "state"
    config = tmp_path / "node.json"
    config.write_text(json.dumps({"runc": str(fake), "shim": str(shim), "state_dir": str(state)}))
    record = tmp_path / "argv"

    def run(*argv: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], "IBCKPT_NODE_CONFIG": str(config), "RECORD": str(record)}
        if "PYTHONPATH" in os.environ:  # a worktree's code, not the editable install's
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return subprocess.run(
            [sys.executable, "-m", "ibckpt_node.hook.runc", *argv],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
        )

    def recorded() -> list[str]:
        return record.read_text().splitlines()

    return {"run": run, "recorded": recorded, "state": state, "shim": shim, "config": config}


def make_bundle(where: Path, spec: dict[str, Any]) -> Path:
    where.mkdir()
    (where / "config.json").write_text(json.dumps(spec))
    (where / "config.json").chmod(0o640)
    return where


GLOBAL = ["--root", "/run/containerd/runc/k8s.io", "--log", "LOG", "--log-format", "json"]


def test_every_other_subcommand_passes_through_untouched(wrapper: dict[str, Any], tmp_path: Path) -> None:
    for argv in (
        ["start", "c1"],
        ["state", "c1"],
        ["kill", "c1", "9"],
        ["delete", "--force", "c1"],
        ["exec", "--process", "/tmp/p.json", "--detach", "c1"],
        ["ps", "--format", "json", "c1"],
        ["checkpoint", "--image-path", "/i", "--leave-running", "c1"],
        ["features"],
        ["--version"],
    ):
        full = [*GLOBAL, *argv]
        done = wrapper["run"](*full)
        assert done.returncode == 0, done.stderr
        assert wrapper["recorded"]() == full


def test_create_of_a_plain_container_leaves_the_bundle_alone(wrapper: dict[str, Any], tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b", containerd_spec())
    before = (bundle / "config.json").read_bytes()
    full = [*GLOBAL, "create", "--bundle", str(bundle), "--pid-file", "/p", "c1"]
    done = wrapper["run"](*full)
    assert done.returncode == 0, done.stderr
    assert wrapper["recorded"]() == full
    assert (bundle / "config.json").read_bytes() == before
    assert not (wrapper["state"] / "containers" / "c1").exists()


def test_create_of_an_rdma_container_edits_then_passes_through(
    wrapper: dict[str, Any], tmp_path: Path
) -> None:
    spec = with_device(containerd_spec())
    spec["process"]["user"] = {"uid": 1234, "gid": 4321}
    bundle = make_bundle(tmp_path / "b", spec)
    full = [*GLOBAL, "create", "--bundle", str(bundle), "--pid-file", "/p", "c1"]
    done = wrapper["run"](*full)
    assert done.returncode == 0, done.stderr
    assert wrapper["recorded"]() == full
    edited = json.loads((bundle / "config.json").read_text())
    assert edited == oci.edit_spec(
        spec, oci.load_config({"IBCKPT_NODE_CONFIG": str(wrapper["config"])}), "c1"
    )
    assert (bundle / "config.json").stat().st_mode & 0o777 == 0o640
    ctl = wrapper["state"] / "containers" / "c1" / "ctl"
    st = ctl.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 4321, 0o700)
    coord = ctl.parent / "coord"  # the container's own, root's: it can plant nothing there
    st = coord.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o755)
    assert not (wrapper["state"] / "coord").exists(), "no directory shared by every container"
    # the agent checkpoints it later through the same runc and state root
    record = json.loads((ctl.parent / "runtime.json").read_text())
    assert record["root"] == runc.global_value(GLOBAL, "root") and record["bundle"] == str(bundle)


def test_create_with_the_bundle_as_working_directory(wrapper: dict[str, Any], tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b", with_device(containerd_spec()))
    done = wrapper["run"]("create", "c2", cwd=bundle)
    assert done.returncode == 0, done.stderr
    assert "LD_PRELOAD=/run/ibckpt/lib/libibckpt.so" in (bundle / "config.json").read_text()


def test_missing_shim_fails_the_create_with_a_reason(wrapper: dict[str, Any], tmp_path: Path) -> None:
    wrapper["shim"].unlink()
    bundle = make_bundle(tmp_path / "b", with_device(containerd_spec()))
    log = tmp_path / "log.json"
    done = wrapper["run"]("--log", str(log), "--log-format", "json", "create", "--bundle", str(bundle), "c1")
    assert done.returncode == 1
    assert "the shim" in done.stderr and "missing" in done.stderr
    assert "missing on this node" in json.loads(log.read_text())["msg"]
    assert not (tmp_path / "argv").exists(), "runc must not have run"


def test_a_bad_container_id_is_refused(wrapper: dict[str, Any], tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "b", with_device(containerd_spec()))
    done = wrapper["run"]("create", "--bundle", str(bundle), "../../etc")
    assert done.returncode == 1 and "bad container id" in done.stderr


def test_installed_launchers_run_with_the_nodes_python_alone(tmp_path: Path) -> None:
    """The installer's copy works without the virtualenv (python3 -IS), and the wrapper's launcher
    passes through to the runc it was installed with, without reading node.json."""
    from ibckpt_node.hook import install

    fake = tmp_path / "runc"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    root = tmp_path / "node"
    install.install(root, "/usr/local", "/usr/bin/python3", None, {"runc": str(fake)})
    assert json.loads((root / "etc/ibckpt/node.json").read_text()) == {"runc": str(fake)}
    for name, first in (("ibckpt-runc", "#!/bin/sh\n"), ("ibckpt-hook", "#!/usr/bin/python3 -IS\n")):
        launcher = root / "usr/local/bin" / name
        assert launcher.read_text().startswith(first)
        # point it at this copy of the library instead of the node's /usr/local
        text = launcher.read_text().replace("'/usr/local/lib", f"'{root}/usr/local/lib")
        launcher.write_text(text.replace('"/usr/local/lib', f'"{root}/usr/local/lib'))
    env = {"PATH": os.environ["PATH"], "RECORD": str(tmp_path / "argv"), "IBCKPT_NODE_CONFIG": "/nonexistent"}
    done = subprocess.run(
        [root / "usr/local/bin/ibckpt-runc", "state", "c1"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == ["state", "c1"]
    bundle = make_bundle(tmp_path / "b", containerd_spec())
    state = json.dumps({"id": "c1", "status": "creating", "bundle": str(bundle), "pid": os.getpid()})
    hook = subprocess.run(
        [root / "usr/local/bin/ibckpt-hook", "createRuntime"],
        input=state,
        env=env,
        capture_output=True,
        text=True,
    )
    assert (hook.returncode, hook.stderr) == (0, "")


def test_the_runc_launcher_starts_python_only_for_create_run_and_start(tmp_path: Path) -> None:
    """containerd bounds a task's delete at 10 s: every call but create, run and start goes from the
    shell launcher to runc without Python (here a python that does not exist), arguments untouched."""
    from ibckpt_node.hook import install

    fake = tmp_path / "runc"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    root = tmp_path / "node"
    install.install(root, "/usr/local", str(tmp_path / "no-python"), None, {"runc": str(fake)})
    wrapper = root / "usr/local/bin/ibckpt-runc"
    env = {"PATH": os.environ["PATH"], "RECORD": str(tmp_path / "argv")}
    argv = ["--root", "/run/x", "--log", "/x/log json", "delete", "--force", "c 1"]
    done = subprocess.run([wrapper, *argv], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == argv
    (root / "usr/local/lib/ibckpt/launch/ibckpt-runc").unlink()  # as the node sees it: not on this host
    for command in ("create", "run", "start"):
        done = subprocess.run([wrapper, command, "c1"], env=env, capture_output=True, text=True)
        assert done.returncode == 127 and "launch/ibckpt-runc" in done.stderr, (command, done)
    other = tmp_path / "other-runc"
    other.write_text(RECORDER)
    other.chmod(0o755)
    killed = subprocess.run([wrapper, "kill", "c1", "9"], env={**env, "IBCKPT_RUNC": str(other)})
    assert killed.returncode == 0 and (tmp_path / "argv").read_text().splitlines() == ["kill", "c1", "9"]


def test_create_fast_path_skips_only_plain_bundles(tmp_path: Path) -> None:
    """With runc known up front, a plain create is exec'd from its bytes alone; an RDMA one is edited."""
    fake = tmp_path / "runc"
    fake.write_text(RECORDER)
    fake.chmod(0o755)
    shim = tmp_path / "libibckpt.so"
    shim.write_bytes(b"\x7fELF")
    (tmp_path / "node.json").write_text(json.dumps({"shim": str(shim), "state_dir": str(tmp_path / "s")}))
    env = {
        "PATH": os.environ["PATH"],
        "RECORD": str(tmp_path / "argv"),
        "IBCKPT_RUNC": str(fake),
        "IBCKPT_NODE_CONFIG": str(tmp_path / "node.json"),
    }
    assert runc.plain(str(make_bundle(tmp_path / "p", containerd_spec())))
    for name, spec, edited in (
        ("plain", containerd_spec(), False),
        ("rdma", with_device(containerd_spec()), True),
    ):
        bundle = make_bundle(tmp_path / name, spec)
        argv = ["create", "--bundle", str(bundle), name]
        done = subprocess.run(
            [sys.executable, "-m", "ibckpt_node.hook.runc", *argv], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "argv").read_text().splitlines() == argv
        assert ("LD_PRELOAD" in (bundle / "config.json").read_text()) is edited


def test_restores_in_one_network_namespace_take_turns(tmp_path: Path) -> None:
    """hostNetwork pods on one node (and the containers of one pod) share a network namespace, where two
    concurrent CRIU restores collide (their fd-transport sockets are named after pid 1, and both lock the
    namespace's iptables): the wrapper holds a lock per namespace around `runc restore`."""
    from ibckpt_node.hook import oci

    config = oci.NodeConfig(runc="/bin/true", shim="/x.so", state_dir=str(tmp_path / "state"))
    # containerd joins each pod's containers to its pause process's namespace: hostNetwork pods have
    # different paths to the one node namespace (here: this process's), which must be one key
    mine = {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/self/ns/net"}]}}
    via_pid = {"linux": {"namespaces": [{"type": "network", "path": f"/proc/{os.getpid()}/ns/net"}]}}
    host = {"linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}}
    own = {"linux": {"namespaces": [{"type": "network"}]}}
    gone = {"linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-gone"}]}}
    node = runc.network_of(host)
    assert node.startswith("netns:") and runc.network_of(mine) == runc.network_of(via_pid) == node
    assert runc.network_of(own) == "own" and runc.network_of(gone) == "/var/run/netns/cni-gone"
    first = runc.hold_restore_lock(config, node)
    try:
        with pytest.raises(oci.Refused, match=f"another restore in network namespace {node} held"):
            runc.hold_restore_lock(config, runc.network_of(via_pid), wait_s=0.3)
        other = runc.hold_restore_lock(config, "/var/run/netns/cni-gone", wait_s=0.3)  # another namespace
        os.close(other)
        assert runc.hold_restore_lock(config, "own") == -1  # its own namespace: nothing to share
    finally:
        os.close(first)
    again = runc.hold_restore_lock(config, node, wait_s=0.3)  # released with the first's fd
    os.close(again)
    assert oct(os.stat(os.path.dirname(runc.restore_lock_path(config, node))).st_mode & 0o777) == "0o700"


def test_each_shim_build_keeps_its_own_file_across_upgrades(tmp_path: Path) -> None:
    """An agent restart must not put a new file under running containers' bind mounts (their processes
    would map a deleted shim, which CRIU cannot restore), and an upgrade must keep the old build: the
    checkpoints of pods started before it restore with the build they mapped."""
    import hashlib

    from ibckpt_node.hook import install

    root, shim = tmp_path / "root", tmp_path / "built.so"
    lib = root / "usr/local/lib/ibckpt"
    config: dict[str, object] = {"runc": "/usr/sbin/runc", "shim": "/usr/local/lib/ibckpt/libibckpt.so"}
    shim.write_bytes(b"\x7fELF one build")
    one = hashlib.sha256(b"\x7fELF one build").hexdigest()
    path = install.install(root, "/usr/local", "/usr/bin/python3", shim, config)
    assert path == f"/usr/local/lib/ibckpt/builds/{one}/libibckpt.so"
    assert json.loads((root / "etc/ibckpt/node.json").read_text())["shim"] == path, "new containers mount it"
    inode = (root / path.lstrip("/")).stat().st_ino
    install.install(root, "/usr/local", "/usr/bin/python3", shim, config)
    assert (root / path.lstrip("/")).stat().st_ino == inode, "the same build is never rewritten"

    shim.write_bytes(b"\x7fELF another build")
    other = hashlib.sha256(b"\x7fELF another build").hexdigest()
    newer = install.install(root, "/usr/local", "/usr/bin/python3", shim, config)
    assert newer == f"/usr/local/lib/ibckpt/builds/{other}/libibckpt.so"
    assert (root / path.lstrip("/")).stat().st_ino == inode, "the old build stays for its checkpoints"
    assert (root / path.lstrip("/")).read_bytes() == b"\x7fELF one build"
    assert install.installed_builds(lib) == sorted([one, other])
    assert json.loads((root / "etc/ibckpt/node.json").read_text())["shim"] == newer


def test_the_shim_of_a_release_before_builds_is_kept_as_a_build(tmp_path: Path) -> None:
    """Pods started before this release mount PREFIX/lib/ibckpt/libibckpt.so: it stays where it is, and
    its bytes become a build too, so their checkpoints restore with it."""
    import hashlib

    from ibckpt_node.hook import install

    lib, shim = tmp_path / "lib", tmp_path / "built.so"
    lib.mkdir()
    (lib / "libibckpt.so").write_bytes(b"\x7fELF before builds")
    inode = (lib / "libibckpt.so").stat().st_ino
    shim.write_bytes(b"\x7fELF new")
    assert install.install_shim(shim, lib) == hashlib.sha256(b"\x7fELF new").hexdigest()
    old = hashlib.sha256(b"\x7fELF before builds").hexdigest()
    assert (lib / "builds" / old / "libibckpt.so").read_bytes() == b"\x7fELF before builds"
    assert (lib / "libibckpt.so").stat().st_ino == inode, "its pods' mounts keep their file"


def test_a_build_whose_bytes_are_not_its_name_is_refused_not_replaced(tmp_path: Path) -> None:
    import hashlib

    from ibckpt_node.hook import install

    lib, shim = tmp_path / "lib", tmp_path / "built.so"
    shim.write_bytes(b"\x7fELF one build")
    digest = hashlib.sha256(b"\x7fELF one build").hexdigest()
    (lib / "builds" / digest).mkdir(parents=True)
    (lib / "builds" / digest / "libibckpt.so").write_bytes(b"something else")
    with pytest.raises(install.InstallError, match=f"holds other bytes than build {digest}"):
        install.install_shim(shim, lib)
    assert (lib / "builds" / digest / "libibckpt.so").read_bytes() == b"something else"
