"""The agent's install puts the image's CRIU plugins on the node beside the shim builds, where runc's CRIU
loads them for a CheckpointJob's pre-dumps; the agent names that dir only once the plugin is there."""

from __future__ import annotations

import json
from pathlib import Path

from ibckpt_node.agent.main import criu_plugins_on_node
from ibckpt_node.hook import install


def test_the_plugins_are_installed_under_the_prefix_and_replaced_whole(tmp_path: Path) -> None:
    image = tmp_path / "image-criu"
    image.mkdir()
    (image / "ibckpt_uverbs.so").write_bytes(b"\x7fELF plugin 1")
    root = tmp_path / "node"
    lib = root / "usr/local/lib/ibckpt"
    assert criu_plugins_on_node("/usr/local", lib) == ""  # before the install: no pre-dumps here
    install.install(root, "/usr/local", "/usr/bin/python3", None, {"runc": "/usr/sbin/runc"}, image)
    plugin = lib / "criu" / "ibckpt_uverbs.so"
    assert plugin.read_bytes() == b"\x7fELF plugin 1" and oct(plugin.stat().st_mode & 0o777) == "0o644"
    assert criu_plugins_on_node("/usr/local", lib) == "/usr/local/lib/ibckpt/criu"
    assert json.loads((root / "etc/ibckpt/node.json").read_text()) == {"runc": "/usr/sbin/runc"}
    # a new release's plugin replaces the file, and leaves no temporary file beside it
    (image / "ibckpt_uverbs.so").write_bytes(b"\x7fELF plugin 2")
    install.install(root, "/usr/local", "/usr/bin/python3", None, None, image)
    assert plugin.read_bytes() == b"\x7fELF plugin 2"
    assert [p.name for p in (lib / "criu").iterdir()] == ["ibckpt_uverbs.so"]


def test_an_image_without_plugins_installs_none(tmp_path: Path) -> None:
    root = tmp_path / "node"
    install.install(root, "/usr/local", "/usr/bin/python3", None, None, tmp_path / "no-such-dir")
    lib = root / "usr/local/lib/ibckpt"
    assert not (lib / "criu").exists() and criu_plugins_on_node("/usr/local", lib) == ""
