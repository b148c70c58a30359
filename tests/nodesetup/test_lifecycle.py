"""The agent's node lifecycle over a node root in a temporary directory and a recording API."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ibckpt_node.nodesetup import host, lifecycle, prereqs
from ibckpt_node.nodesetup.kube import KubeError

STOCK = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "runc"\n'


class FakeApi:
    def __init__(self, daemonset: dict[str, Any] | KubeError | None = None) -> None:
        self.patches: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._daemonset = daemonset

    def node(self, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "uid": "u-1"}}

    def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)

    def post_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def daemonset(self, namespace: str, name: str) -> dict[str, Any] | None:
        if isinstance(self._daemonset, KubeError):
            raise self._daemonset
        return self._daemonset


def node_root(tmp_path: Path) -> host.NodeSetup:
    (tmp_path / "etc/containerd").mkdir(parents=True)
    (tmp_path / "etc/containerd/config.toml").write_text(STOCK)
    for name in ("ibckpt-runc", "ibckpt-hook"):
        (tmp_path / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "usr/local/bin" / name).write_text("#!/bin/sh\n")
    (tmp_path / "usr/local/lib/ibckpt/python").mkdir(parents=True)
    (tmp_path / "usr/local/lib/ibckpt/libibckpt.so").write_text("elf")
    (tmp_path / "etc/ibckpt").mkdir()
    (tmp_path / "etc/ibckpt/node.json").write_text("{}")
    return host.NodeSetup(tmp_path, "/usr/local", "/usr/sbin/runc", "/usr/bin/python3", restart="none")


def life(setup: host.NodeSetup, api: FakeApi) -> lifecycle.NodeLifecycle:
    return lifecycle.NodeLifecycle("node-1", setup, api, "ibckpt-system", "ibckpt-agent")  # type: ignore[arg-type]


def test_a_missing_prerequisite_keeps_the_agent_not_ready_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = node_root(tmp_path)
    missing = prereqs.criu(0, "Version: 3.16\n")
    monkeypatch.setattr(host, "check", lambda s: [missing, prereqs.Finding("shim", True, "x")])
    api = FakeApi()
    node = life(setup, api)
    assert not node.prepare() and not node.ready
    assert (
        node.reason
        == "node node-1 lacks what the ibckpt agent needs: criu: version 3.16.0 is older than 3.17.0"
    )
    assert api.patches == [{"metadata": {"labels": {"ibckpt.io/runtime-ready": None}}}]
    assert [e["reason"] for e in api.events] == ["NodePrerequisiteMissing"]
    node.prepare()
    assert len(api.events) == 1  # the same finding is posted once per agent
    assert (tmp_path / "etc/containerd/config.toml").read_text() == STOCK  # nothing touched


def test_all_present_installs_restarts_and_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = node_root(tmp_path)
    monkeypatch.setattr(host, "check", lambda s: [prereqs.Finding("criu", True, "3.17.1")])
    loaded = {"now": False}
    monkeypatch.setattr(host, "containerd_loaded", lambda s: loaded["now"])

    def restart(s: host.NodeSetup) -> str:
        loaded["now"] = True
        return ""

    monkeypatch.setattr(host, "restart_containerd", restart)
    api = FakeApi()
    node = life(setup, api)
    assert node.prepare() and node.ready and loaded["now"]
    config = (tmp_path / "etc/containerd/config.toml").read_text()
    assert config.startswith(STOCK) and 'BinaryName = "/usr/local/bin/ibckpt-runc"' in config
    assert api.patches[-1] == {"metadata": {"labels": {"ibckpt.io/runtime-ready": "true"}}}
    assert api.events[-1]["reason"] == "RuntimeHandlerReady"


def test_a_restart_nothing_does_is_a_reason_not_to_be_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = node_root(tmp_path)
    monkeypatch.setattr(host, "check", lambda s: [])
    monkeypatch.setattr(host, "containerd_pids", lambda: [])
    api = FakeApi()
    node = life(setup, api)
    assert not node.prepare()
    assert "containerd must be restarted" in node.reason and api.patches == []


def test_unmanaged_runtime_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = node_root(tmp_path)
    monkeypatch.setattr(host, "check", lambda s: [])
    api = FakeApi()
    node = life(host.NodeSetup(**{**setup.__dict__, "manage": False}), api)
    assert node.prepare()
    assert (tmp_path / "etc/containerd/config.toml").read_text() == STOCK


@pytest.mark.parametrize(
    ("daemonset", "uninstall"),
    [
        (None, True),
        ({"metadata": {"deletionTimestamp": "2026-12-01T00:00:00Z"}}, True),
        ({"metadata": {}}, False),
        (KubeError(403, "forbidden"), False),
    ],
)
def test_only_a_deleted_daemonset_is_an_uninstall(tmp_path: Path, daemonset: Any, uninstall: bool) -> None:
    assert life(node_root(tmp_path), FakeApi(daemonset)).uninstalling() is uninstall


def test_uninstall_undoes_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = node_root(tmp_path)
    host.install_handler(setup)
    restarts: list[int] = []

    def restart(s: host.NodeSetup) -> str:
        restarts.append(1)
        return ""

    monkeypatch.setattr(host, "restart_containerd", restart)
    api = FakeApi(None)
    done = life(setup, api).uninstall()
    assert (tmp_path / "etc/containerd/config.toml").read_text() == STOCK and restarts == [1]
    assert api.patches == [{"metadata": {"labels": {"ibckpt.io/runtime-ready": None}}}]
    assert not (tmp_path / "usr/local/bin/ibckpt-runc").exists()
    assert not (tmp_path / "etc/ibckpt/node.json").exists()
    assert list((tmp_path / "usr/local/lib/ibckpt").iterdir()) == []
    assert "/usr/local/bin/ibckpt-runc" in done and api.events[-1]["reason"] == "RuntimeHandlerRemoved"


def test_files_stay_while_a_container_runs_through_the_wrapper(tmp_path: Path) -> None:
    setup = node_root(tmp_path)
    task = tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io/abc123"
    task.mkdir(parents=True)
    (task / "options.json").write_text('{"binary_name":"/usr/local/bin/ibckpt-runc"}')
    assert host.remove_files(setup) == [
        "kept the wrapper, hook and shim: containers abc123 still run through it"
    ]
    assert (tmp_path / "usr/local/bin/ibckpt-runc").exists()


def test_a_v3_node_gets_and_loses_its_drop_in(tmp_path: Path) -> None:
    setup = node_root(tmp_path)
    (tmp_path / "etc/containerd/config.toml").write_text("version = 3\n")
    edit = host.install_handler(setup)
    assert edit.changed and (tmp_path / "etc/containerd/conf.d/ibckpt.toml").is_file()
    assert host.install_handler(setup).changed is False
    assert host.remove_handler(setup).changed
    assert (tmp_path / "etc/containerd/config.toml").read_text() == "version = 3\n"
    assert not (tmp_path / "etc/containerd/conf.d/ibckpt.toml").exists()


def test_the_next_runtime_is_looked_for_on_the_whole_node_not_only_the_charts_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart mounts only ibckpt's own directories under /host; runc lives in the node's /usr/sbin."""
    mounts = node_root(tmp_path / "mounts")
    node = tmp_path / "node"
    monkeypatch.setattr(host, "run_on_node", lambda argv, timeout_s=30.0: (0, "Version: 3.17.1\n3 11\n"))
    setup = host.NodeSetup(**{**mounts.__dict__, "node_fs": node})

    def runtime() -> prereqs.Finding:
        return next(f for f in host.check(setup) if f.name == "next runtime")

    assert runtime() == prereqs.Finding("next runtime", False, "/usr/sbin/runc does not exist on the node")
    (node / "usr/sbin").mkdir(parents=True)
    (node / "usr/sbin/runc").write_text("#!/bin/sh\n")
    (node / "usr/sbin/runc").chmod(0o755)
    assert runtime().ok, runtime()


def test_a_probe_that_answers_late_is_bounded_and_says_so() -> None:
    """A slow node is told apart from one that lacks a program: the finding names the bound it ran out."""
    assert host.run_on_node(["sh", "-c", "echo 3 11"]) == (0, "3 11\n")
    status, said = host.run_on_node(["sleep", "5"], timeout_s=0.2)
    assert status is None and said == "no answer within 0.2s"
    finding = prereqs.python("/usr/bin/python3", status, said)
    assert not finding.ok
    assert finding.detail == "/usr/bin/python3 cannot run on the node (no answer within 0.2s)"
    assert host.PROBE_TIMEOUT_S >= 120  # seen: over 30 s for python3's start on a busy emulated node


def test_containerd_is_back_only_once_its_socket_accepts(tmp_path: Path) -> None:
    import socket

    setup = dataclasses.replace(node_root(tmp_path), node_fs=tmp_path)
    where = tmp_path / "run/containerd/containerd.sock"  # containerd's default: the config names none
    where.parent.mkdir(parents=True)
    assert not host.containerd_answers(setup)  # no socket yet: the process is up, not serving
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(where))
        assert not host.containerd_answers(setup)  # bound, not listening
        server.listen(1)
        assert host.containerd_answers(setup)
    assert not host.containerd_answers(setup)  # gone again (the file stays, nothing accepts)

    # a node whose containerd serves elsewhere, as its config says
    config = tmp_path / "etc/containerd/config.toml"
    config.write_text(STOCK + '[grpc]\n  address = "/run/k8s/containerd.sock"\n')
    elsewhere = tmp_path / "run/k8s/containerd.sock"
    elsewhere.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(elsewhere))
        server.listen(1)
        assert host.containerd_answers(setup)
