"""The runtime handler in containerd's config: install and remove round trips on the layouts nodes have."""

from __future__ import annotations

import tomllib

import pytest

from ibckpt_node.nodesetup import containerd as c

CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/conf.d/ibckpt.toml"
H = c.Handler(binary="/usr/local/bin/ibckpt-runc")

# containerd 1.6's `containerd config default`, abridged, with its comments and indentation
STOCK_16 = """disabled_plugins = []
imports = []
oom_score = 0
plugin_dir = ""
required_plugins = []
root = "/var/lib/containerd"
state = "/run/containerd"
temp = ""
version = 2

[cgroup]
  path = ""

[plugins]

  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.6"

    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/opt/cni/bin"
      conf_dir = "/etc/cni/net.d"

    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      snapshotter = "overlayfs"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"

          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            BinaryName = ""
            SystemdCgroup = true

[timeouts]
  "io.containerd.timeout.shim.cleanup" = "5s"
"""

# a GPU node's: imports of its own, another runtime as the default, comments
WITH_OTHERS = """# managed by the node image
version = 2
imports = ["/etc/containerd/extra.toml"]  # site settings

[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
      BinaryName = "/usr/bin/nvidia-container-runtime"
      SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
    runtime_type = "io.containerd.kata.v2"
"""

STOCK_20 = """version = 3
root = '/var/lib/containerd'
state = '/run/containerd'

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          SystemdCgroup = true
"""


def handler(data: dict, plugin: str) -> dict:  # type: ignore[type-arg]
    return data["plugins"][plugin]["containerd"]["runtimes"]["ibckpt"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("text", [STOCK_16, WITH_OTHERS], ids=["stock-1.6", "imports-and-runtimes"])
def test_v2_install_appends_one_block_and_remove_gives_the_same_bytes(text: str) -> None:
    edit = c.install(text, H, CONFIG, DROPIN)
    assert edit.changed and edit.dropin is None
    assert edit.main.startswith(text)  # every byte of the node's config before ours
    data = tomllib.loads(edit.main)
    ours = handler(data, c.CRI_V2)
    assert ours["runtime_type"] == "io.containerd.runc.v2"
    assert ours["options"]["BinaryName"] == "/usr/local/bin/ibckpt-runc"
    assert ours["pod_annotations"] == ["ibckpt.io/*"]
    old = tomllib.loads(text)
    assert data["plugins"][c.CRI_V2]["containerd"]["runtimes"].keys() - {"ibckpt"} == (
        old["plugins"][c.CRI_V2]["containerd"]["runtimes"].keys()
    )
    assert c.has_handler(edit.main, H)
    again = c.install(edit.main, H, CONFIG, DROPIN)
    assert not again.changed and again.main == edit.main  # idempotent: no restart at the next start
    back = c.remove(edit.main, DROPIN)
    assert back.changed and back.main == text


def test_the_handler_uses_the_default_runtimes_cgroup_driver() -> None:
    assert handler(tomllib.loads(c.install(STOCK_16, H, CONFIG, DROPIN).main), c.CRI_V2)["options"][
        "SystemdCgroup"
    ]
    # the default is nvidia there, with cgroupfs
    others = handler(tomllib.loads(c.install(WITH_OTHERS, H, CONFIG, DROPIN).main), c.CRI_V2)
    assert others["options"]["SystemdCgroup"] is False
    bare = "version = 2\n"
    assert (
        "SystemdCgroup"
        not in handler(tomllib.loads(c.install(bare, H, CONFIG, DROPIN).main), c.CRI_V2)["options"]
    )


def test_a_new_wrapper_path_replaces_the_block() -> None:
    first = c.install(STOCK_16, H, CONFIG, DROPIN).main
    moved = c.install(first, c.Handler(binary="/opt/ibckpt/bin/ibckpt-runc"), CONFIG, DROPIN)
    assert moved.changed and moved.main.count(c.BEGIN) == 1
    assert (
        handler(tomllib.loads(moved.main), c.CRI_V2)["options"]["BinaryName"] == "/opt/ibckpt/bin/ibckpt-runc"
    )
    assert c.remove(moved.main, DROPIN).main == STOCK_16


def test_a_file_without_a_final_newline_comes_back_the_same() -> None:
    text = 'version = 2\nroot = "/x"'
    edit = c.install(text, H, CONFIG, DROPIN)
    tomllib.loads(edit.main)
    assert c.remove(edit.main, DROPIN).main == text


def test_someone_elses_handler_of_that_name() -> None:
    theirs = STOCK_16 + (
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.ibckpt]\n'
        '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.ibckpt.options]\n'
        '    BinaryName = "/usr/local/bin/ibckpt-runc"\n'
    )
    edit = c.install(theirs, H, CONFIG, DROPIN)
    assert not edit.changed and edit.main == theirs and "left as is" in edit.note
    assert c.remove(theirs, DROPIN).main == theirs  # not ours to remove
    other = theirs.replace("/usr/local/bin/ibckpt-runc", "/usr/bin/something")
    with pytest.raises(c.ConfigRefused, match="whose BinaryName is '/usr/bin/something'"):
        c.install(other, H, CONFIG, DROPIN)


def test_v3_gets_a_drop_in_and_an_imports_entry() -> None:
    edit = c.install(STOCK_20, H, CONFIG, DROPIN)
    assert edit.changed and edit.dropin is not None
    main = tomllib.loads(edit.main)
    assert main["imports"] == [DROPIN]
    assert main["plugins"] == tomllib.loads(STOCK_20)["plugins"]
    dropin = tomllib.loads(edit.dropin)
    assert dropin["version"] == 3
    ours = handler(dropin, c.CRI_V3)
    assert ours["options"] == {"BinaryName": "/usr/local/bin/ibckpt-runc", "SystemdCgroup": True}
    assert c.has_handler(edit.main, H, edit.dropin)
    back = c.remove(edit.main, DROPIN)
    assert back.main == STOCK_20 and back.dropin == ""


def test_v3_with_imports_keeps_them_and_their_comments() -> None:
    text = STOCK_20.replace("version = 3\n", 'version = 3\nimports = ["/etc/a.toml"]  # site\n')
    edit = c.install(text, H, CONFIG, DROPIN)
    assert tomllib.loads(edit.main)["imports"] == ["/etc/a.toml", DROPIN]
    assert "# site" in edit.main
    assert c.remove(edit.main, DROPIN).main == text


def test_v3_whose_glob_already_imports_the_drop_in_is_left_alone() -> None:
    for entry in ("/etc/containerd/conf.d/*.toml", "conf.d/*.toml"):
        text = STOCK_20.replace("version = 3\n", f'version = 3\nimports = ["{entry}"]\n')
        edit = c.install(text, H, CONFIG, DROPIN)
        assert edit.main == text and edit.dropin is not None and not edit.changed
        back = c.remove(text, DROPIN)
        assert back.main == text and back.dropin == ""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[plugins.cri]\nsandbox_image = "x"\n', "version 1"),
        ("version = 4\n", "version 4"),
        ("version = 2\n[plugins\n", "not valid TOML"),
    ],
)
def test_layouts_it_does_not_edit_are_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(c.ConfigRefused, match=says):
        c.install(text, H, CONFIG, DROPIN)


def test_a_block_without_its_end_is_refused() -> None:
    with pytest.raises(c.ConfigRefused, match="no end marker"):
        c.install("version = 2\n" + c.BEGIN, H, CONFIG, DROPIN)
