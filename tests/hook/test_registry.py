"""Host tests of the container registry and of ibckpt-hook against it (real sockets, real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node.hook import client, oci
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer


def entry_for(pid: int, cid: str = "c1", **over: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "container_id": cid,
        "namespace": "ml",
        "pod": "job-0",
        "pod_uid": "u1",
        "container": "trainer",
        "pid": pid,
        "pid_start": client.process_start(pid),
        "control_dir": "",
        "control_socket": "",
        "shim": True,
        "reason": "test",
        "registered_at": time.time(),
    }
    entry.update(over)
    return entry


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


class Served:
    """A registry served from a thread with its own event loop, so blocking clients can call it."""

    def __init__(self, state: Path, allowed: tuple[int, ...] = (0,)) -> None:
        self.registry = ContainerRegistry(state, allowed)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.registry.start())
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.registry.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "state")
    yield s
    s.stop()


def test_register_list_deregister(served: Served, sleeper: subprocess.Popen[bytes]) -> None:
    path = served.registry.config.registry_socket
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    client.register(path, entry_for(sleeper.pid), 2.0)
    (listed,) = client.list_entries(path)
    assert (listed["container_id"], listed["pid"], listed["namespace"], listed["shim"]) == (
        "c1",
        sleeper.pid,
        "ml",
        True,
    )
    assert client.deregister(path, "c1", 2.0) is True
    assert client.deregister(path, "c1", 2.0) is False
    assert client.list_entries(path) == []


def test_dead_and_reused_pids_are_dropped(served: Served, sleeper: subprocess.Popen[bytes]) -> None:
    path = served.registry.config.registry_socket
    client.register(path, entry_for(sleeper.pid, "alive"), 2.0)
    client.register(path, entry_for(sleeper.pid, "reused", pid_start=1), 2.0)  # same pid, other process
    sleeper.kill()
    sleeper.wait()
    assert client.list_entries(path) == []
    proc = subprocess.Popen(["sleep", "300"])
    try:
        client.register(path, entry_for(proc.pid, "c2", shim=False), 2.0)
        assert [e["container_id"] for e in client.list_entries(path)] == ["c2"]
        assert served.registry.checkpointable() == []
    finally:
        proc.kill()
        proc.wait()


def test_bad_requests_get_a_reason(served: Served, sleeper: subprocess.Popen[bytes]) -> None:
    path = served.registry.config.registry_socket
    with pytest.raises(client.RegistryError, match="pid"):
        client.register(path, entry_for(sleeper.pid) | {"pid": 0}, 2.0)
    with pytest.raises(client.RegistryError, match="Extra inputs"):
        client.register(path, entry_for(sleeper.pid, token="x"), 2.0)
    with pytest.raises(client.RegistryError, match="bad container id"):
        client.register(path, entry_for(sleeper.pid, "../x"), 2.0)
    with pytest.raises(client.RegistryError, match="unknown op"):
        client.request(path, {"op": "drop-all"}, 2.0)
    assert served.registry.handle({"v": 2, "op": "list"})["ok"] is False


def test_a_uid_not_allowed_is_refused(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    s = Served(tmp_path / "state", allowed=(4242,))  # this test runs as another uid than 4242
    try:
        refused = f"uid {os.getuid()} may not use the registry"
        with pytest.raises(client.RegistryError, match=refused):
            client.list_entries(s.registry.config.registry_socket)
        # the registry answers a refused uid before it reads, and closes: a request still being sent
        # then breaks its pipe, and the client must still read the reason (seen once in CI as a race)
        with pytest.raises(client.RegistryError, match=refused):
            client.request(s.registry.config.registry_socket, {"op": "list", "pad": "x" * (4 << 20)}, 5.0)
    finally:
        s.stop()


def test_rediscovery_of_registrations_made_while_no_registry_ran(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    state = tmp_path / "state"
    for cid, pid in (("up", sleeper.pid), ("gone", 999999)):
        cdir = state / "containers" / cid
        cdir.mkdir(parents=True)
        entry = entry_for(sleeper.pid, cid)
        entry["pid"] = pid
        client.write_json_atomic(str(cdir / "registration.json"), entry)
    (state / "containers" / "junk").mkdir()
    (state / "containers" / "junk" / "registration.json").write_text("{")
    registry = ContainerRegistry(state)
    assert registry.rediscover() == 1
    assert [e.container_id for e in registry.entries()] == ["up"]


# ---- ibckpt-hook as the runtime runs it: state on stdin, bundle on disk -------------------


def run_hook(config: Path, state: dict[str, Any], *stage: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "IBCKPT_NODE_CONFIG": str(config)}
    return subprocess.run(
        [sys.executable, "-m", "ibckpt_node.hook.main", *stage],
        input=json.dumps(state),
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def node_config(tmp_path: Path, state: Path) -> Path:
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"state_dir": str(state), "registry_timeout_s": 0.5}))
    return path


def bundle_with(tmp_path: Path, spec: dict[str, Any], cid: str) -> dict[str, Any]:
    bundle = tmp_path / f"bundle-{cid}"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(spec))
    return {"ociVersion": "1.0.2", "id": cid, "status": "creating", "bundle": str(bundle)}


def test_hook_registers_an_rdma_container_and_deregisters_it(
    tmp_path: Path, served: Served, sleeper: subprocess.Popen[bytes]
) -> None:
    config = node_config(tmp_path, Path(served.registry.config.state_dir))
    spec = oci.edit_spec(with_device(containerd_spec()), served.registry.config, "c1")
    state = bundle_with(tmp_path, spec, "c1") | {"pid": sleeper.pid}
    done = run_hook(config, state, "createRuntime")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (entry,) = served.registry.entries()
    assert (entry.container_id, entry.pid, entry.pod_uid, entry.container, entry.shim) == (
        "c1",
        sleeper.pid,
        "0b9e2d1c-1111-4222-8333-444455556666",
        "trainer",
        True,
    )
    cdir = Path(served.registry.config.container_dir("c1"))
    assert entry.control_dir == str(cdir / "ctl")
    assert entry.control_socket == str(cdir / "ctl" / f"{sleeper.pid}.sock")  # no pid namespace here
    assert RegisteredContainer.model_validate_json((cdir / "registration.json").read_text()) == entry
    # poststop, with the stage read from the state's status (one hooks.d entry for both)
    done = run_hook(config, state | {"status": "stopped"})
    assert done.returncode == 0, done.stderr
    assert served.registry.entries() == []
    assert not cdir.exists()


def test_hook_ignores_a_plain_container(
    tmp_path: Path, served: Served, sleeper: subprocess.Popen[bytes]
) -> None:
    config = node_config(tmp_path, Path(served.registry.config.state_dir))
    state = bundle_with(tmp_path, containerd_spec(), "plain") | {"pid": sleeper.pid}
    done = run_hook(config, state, "createRuntime")
    assert (done.returncode, done.stderr) == (0, "")
    assert served.registry.entries() == []
    assert not (Path(served.registry.config.state_dir) / "containers" / "plain").exists()


def test_hook_marks_an_rdma_container_without_the_shim(
    tmp_path: Path, served: Served, sleeper: subprocess.Popen[bytes]
) -> None:
    config = node_config(tmp_path, Path(served.registry.config.state_dir))
    state = bundle_with(tmp_path, with_device(containerd_spec()), "noshim") | {"pid": sleeper.pid}
    done = run_hook(config, state, "createRuntime")
    assert done.returncode == 0
    assert "runs without the shim" in done.stderr
    (entry,) = served.registry.entries()
    assert entry.shim is False and entry.control_socket == ""


def test_hook_without_an_agent_does_not_block_the_container(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    state_dir = tmp_path / "state"
    config = node_config(tmp_path, state_dir)
    spec = oci.edit_spec(with_device(containerd_spec()), oci.NodeConfig(state_dir=str(state_dir)), "c1")
    state = bundle_with(tmp_path, spec, "c1") | {"pid": sleeper.pid}
    # a socket that accepts and never answers: the hook must give up within its bound
    import socket

    state_dir.mkdir()
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(state_dir / "registry.sock"))
    hung.listen(8)
    try:
        t0 = time.monotonic()
        done = run_hook(config, state, "createRuntime")
        took = time.monotonic() - t0
    finally:
        hung.close()
    assert done.returncode == 0
    assert took < 5.0, f"the hook took {took:.1f}s"
    assert "not registered now" in done.stderr
    assert "not registered now" in (state_dir / "hook.log").read_text()
    # ... and a registry that starts later finds it
    registry = ContainerRegistry(state_dir)
    assert registry.rediscover() == 1
    assert registry.entries()[0].pid == sleeper.pid


def test_hook_never_fails_the_container(tmp_path: Path) -> None:
    config = node_config(tmp_path, tmp_path / "state")
    done = run_hook(config, {"id": "x", "bundle": str(tmp_path / "nowhere")}, "createRuntime")
    assert done.returncode == 0 and "FileNotFoundError" in done.stderr


def test_sockets_lists_only_real_sockets_in_the_containers_directory(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    import socket

    ctl = tmp_path / "ctl"
    ctl.mkdir()
    real = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    real.bind(str(ctl / "1.sock"))
    host_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host_socket.bind(str(tmp_path / "host.sock"))
    try:
        # the container owns ctl/: a symlink there must not lead the agent to a host socket
        (ctl / "2.sock").symlink_to(tmp_path / "host.sock")
        (ctl / "3.sock").write_text("")
        entry = RegisteredContainer.model_validate(entry_for(sleeper.pid) | {"control_dir": str(ctl)})
        assert entry.sockets() == [str(ctl / "1.sock")]
    finally:
        real.close()
        host_socket.close()


def test_the_hooks_fast_path_only_skips_what_cannot_be_ours(tmp_path: Path) -> None:
    from ibckpt_node.hook import main

    def state_for(spec: dict[str, Any], **extra: Any) -> str:
        return json.dumps(bundle_with(tmp_path, spec, f"f{len(list(tmp_path.iterdir()))}") | extra)

    assert main.not_ours(state_for(containerd_spec())) is True
    assert main.not_ours(state_for(with_device(containerd_spec()))) is False
    assert main.not_ours(state_for(containerd_spec(**{"ibckpt.io/enabled": "true"}))) is False
    escaped = tmp_path / "escaped"
    escaped.mkdir()
    escaped_device = '{"linux": {"devices": [{"path": "\\/dev\\/infiniband\\/uverbs0"}]}}'
    (escaped / "config.json").write_text(escaped_device)
    assert main.not_ours(json.dumps({"id": "e", "bundle": str(escaped)})) is False
    # what the fast path cannot read goes the full way
    assert main.not_ours('{"id": "x", "bundle": "/nowhere"}') is False
    assert main.not_ours('{"bundle": "/a\\"b"}') is False
    assert main.string_field('{"id":"c1","bundle":"/b/x"}', "bundle") == "/b/x"
    assert main.string_field('{"bundle":"/b\\\\x"}', "bundle") is None
    assert main.string_field('{"bundle" :  "/b/y", "id": 1}', "bundle") == "/b/y"
    assert main.string_field('{"bundle": 7}', "bundle") is None
    assert main.string_field('{"bundle": "/b", "annotations": {"bundle": "/x"}}', "bundle") is None
