"""The compiled front of ibckpt-hook and ibckpt-runc (native/front), as the installer puts it on a node.

Its sanitizer build (ASan and UBSan) is installed as both entry points; stand-ins that record their
argv and stdin take the places of runc and of the Python launchers it hands calls to. So each test
shows which of the two got a call, and that it got it untouched. The real runtimes run the front in
the guest (test_hook_guest.py: podman, hooks.d) and on the cluster's nodes (containerd).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node.hook import install

FRONT = Path(__file__).resolve().parents[2] / "native" / "build" / "hosttests" / "ibckpt-front-asan"

RECORDER = """#!/bin/sh
# records who ran, its argv (one per line) and its stdin
{{ echo {who}; for a in "$@"; do printf '%s\\n' "$a"; done; }} > "$RECORD"
cat > "$RECORD.stdin"
"""


class Node:
    def __init__(self, tmp: Path) -> None:
        assert FRONT.is_file(), f"no {FRONT}: run `make native`"
        self.tmp = tmp
        self.root = tmp / "node"
        self.record = tmp / "record"
        runc = self.stand_in(tmp / "runc", "runc")
        install.install(self.root, "/usr/local", "/usr/bin/python3", None, {"runc": str(runc)}, front=FRONT)
        self.lib = self.root / "usr/local/lib/ibckpt"
        assert os.readlink(self.lib / "runc") == str(runc)
        for name in ("ibckpt-hook", "ibckpt-runc"):
            assert (self.root / "usr/local/bin" / name).read_bytes() == FRONT.read_bytes()
            self.stand_in(self.lib / "launch" / name, f"launch/{name}")

    def stand_in(self, path: Path, who: str) -> Path:
        path.write_text(RECORDER.format(who=who))
        path.chmod(0o755)
        return path

    def run(self, name: str, *argv: str, stdin: str = "", cwd: Path | None = None, **env: str) -> list[str]:
        """Runs the entry point; returns who got the call and its argv ([] when nobody did)."""
        self.record.unlink(missing_ok=True)
        done = subprocess.run(
            [self.root / "usr/local/bin" / name, *argv],
            input=stdin,
            env={"PATH": os.environ["PATH"], "RECORD": str(self.record), **env},
            cwd=cwd or self.tmp,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and "Sanitizer" not in done.stderr, (argv, done)
        return self.record.read_text().splitlines() if self.record.exists() else []

    def stdin_seen(self) -> str:
        return Path(f"{self.record}.stdin").read_text()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def bundle(where: Path, spec: dict[str, Any] | str) -> Path:
    where.mkdir()
    (where / "config.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
    return where


def test_every_runc_call_but_create_run_and_start_goes_straight_to_runc(node: Node) -> None:
    for argv in (
        ["--root", "/run/x", "--log", "/x/log json", "delete", "--force", "c 1"],
        ["--root=/run/x", "-log-format", "json", "state", "c1"],
        ["--systemd-cgroup", "kill", "c1", "9"],
        ["--", "events", "create"],  # "create" here is an argument, not the command
        ["features"],
        [],
    ):
        assert node.run("ibckpt-runc", *argv) == ["runc", *argv]
    other = node.stand_in(node.tmp / "other-runc", "other")
    assert node.run("ibckpt-runc", "ps", "c1", IBCKPT_RUNC=str(other)) == ["other", "ps", "c1"]


def test_a_plain_create_goes_to_runc_and_an_rdma_one_to_python(node: Node) -> None:
    plain = bundle(node.tmp / "plain", containerd_spec())
    rdma = bundle(node.tmp / "rdma", with_device(containerd_spec()))
    for command in ("create", "run"):
        for form in (["--bundle", "{}"], ["-b", "{}"], ["--bundle={}"], ["-b={}"]):
            for where, who in ((plain, "runc"), (rdma, "launch/ibckpt-runc")):
                argv = ["--root", "/r", command, "--pid-file", "p", *(f.format(where) for f in form), "c1"]
                assert node.run("ibckpt-runc", *argv) == [who, *argv], (command, form, where)
        # no --bundle: the working directory
        assert node.run("ibckpt-runc", command, "c1", cwd=plain) == ["runc", command, "c1"]
        assert node.run("ibckpt-runc", command, "c1", cwd=rdma) == ["launch/ibckpt-runc", command, "c1"]


def test_what_the_front_cannot_decide_goes_to_python(node: Node) -> None:
    annotated = bundle(node.tmp / "annotated", containerd_spec(**{"ibckpt.io/enabled": "true"}))
    escaped = bundle(node.tmp / "escaped", json.dumps(with_device(containerd_spec())).replace("/", "\\/"))
    python = "launch/ibckpt-runc"
    for argv in (
        ["create", "--bundle", str(annotated), "c1"],
        ["create", "--bundle", str(escaped), "c1"],  # the markers could hide behind escapes
        ["create", "--bundle", str(node.tmp / "nowhere"), "c1"],  # no config.json to read
        ["create", "--bundle"],  # no value
        ["start", "c1"],  # a restored container's start is answered by the wrapper
    ):
        assert node.run("ibckpt-runc", *argv) == [python, *argv]


def test_the_hook_exits_for_a_plain_container_and_hands_the_rest_over_with_its_state(node: Node) -> None:
    plain = bundle(node.tmp / "plain", containerd_spec())
    rdma = bundle(node.tmp / "rdma", with_device(containerd_spec()))
    state = {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 42}
    assert node.run("ibckpt-hook", "createRuntime", stdin=json.dumps({**state, "bundle": str(plain)})) == []
    assert node.run("ibckpt-hook", stdin=json.dumps({**state, "bundle": str(plain)}, indent=2)) == []
    for text in (
        json.dumps({**state, "bundle": str(rdma)}),
        json.dumps({**state, "bundle": str(plain).replace("/", "\\/")}),  # escaped: parsed in Python
        json.dumps({**state, "bundle": str(plain), "annotations": {"bundle": "x"}})[:-1] + ', "bundle": "y"}',
        json.dumps(state),  # no bundle
        "",
        "x" * (1 << 20),  # a long state passes whole
    ):
        assert node.run("ibckpt-hook", "poststop", stdin=text) == ["launch/ibckpt-hook", "poststop"]
        assert node.stdin_seen() == text


def test_under_another_name_the_front_says_what_it_is(tmp_path: Path) -> None:
    other = tmp_path / "runc"
    other.write_bytes(FRONT.read_bytes())
    other.chmod(0o755)
    done = subprocess.run([other, "state"], capture_output=True, text=True)
    assert done.returncode == 2 and "runs as ibckpt-hook or ibckpt-runc" in done.stderr, done
