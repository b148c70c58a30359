"""Host unit tests: which containers go under the shim, and the config.json edit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hook.specs import containerd_spec, with_device

from ibckpt_node.hook import oci

CONFIG = oci.NodeConfig(shim="/opt/ib/libibckpt.so", hook="/opt/ib/bin/ibckpt-hook", state_dir="/run/ibk")


def test_rdma_device_selects_the_container() -> None:
    assert oci.wants_shim(containerd_spec()) is None
    assert oci.wants_shim(with_device(containerd_spec())) == "RDMA device /dev/infiniband/uverbs0"
    # a GPU or any other device is not RDMA
    assert oci.wants_shim(with_device(containerd_spec(), "/dev/nvidia0")) is None


def test_hostpath_mount_of_dev_infiniband_selects_the_container() -> None:
    spec = containerd_spec()
    spec["mounts"].append({"destination": "/dev/infiniband", "type": "bind", "source": "/dev/infiniband"})
    assert oci.wants_shim(spec) == "RDMA device /dev/infiniband"
    spec = containerd_spec()
    spec["mounts"].append({"destination": "/dev/infiniband-x", "type": "bind", "source": "/tmp/x"})
    assert oci.wants_shim(spec) is None


def test_annotations_opt_in_and_out() -> None:
    assert oci.wants_shim(containerd_spec(**{"ibckpt.io/enabled": "true"})) == "annotation ibckpt.io/enabled"
    assert oci.wants_shim(with_device(containerd_spec(**{"ibckpt.io/enabled": "false"}))) is None
    only_other = containerd_spec(**{"ibckpt.io/enabled": "true", "ibckpt.io/containers": "sidecar, x"})
    assert oci.wants_shim(only_other) is None
    only_me = with_device(containerd_spec(**{"ibckpt.io/containers": "sidecar,trainer"}))
    assert oci.wants_shim(only_me) is not None


def test_the_pause_container_is_never_touched() -> None:
    spec = with_device(containerd_spec(**{"ibckpt.io/enabled": "true"}))
    spec["annotations"]["io.kubernetes.cri.container-type"] = "sandbox"
    assert oci.wants_shim(spec) is None
    crio = with_device(
        {"annotations": {"io.kubernetes.cri-o.ContainerType": "sandbox"}, "linux": {"devices": []}}
    )
    assert oci.wants_shim(crio) is None


def test_identity_from_containerd_and_crio() -> None:
    who = oci.identity(containerd_spec())
    assert (who.namespace, who.pod, who.pod_uid, who.container, who.sandbox) == (
        "ml",
        "job-0",
        "0b9e2d1c-1111-4222-8333-444455556666",
        "trainer",
        False,
    )
    crio = {
        "annotations": {
            "io.kubernetes.pod.namespace": "hpc",
            "io.kubernetes.pod.name": "mpi-1",
            "io.kubernetes.pod.uid": "u-1",
            "io.kubernetes.container.name": "rank",
            "io.kubernetes.cri-o.ContainerType": "container",
        }
    }
    assert oci.identity(crio).as_dict() == {
        "namespace": "hpc",
        "pod": "mpi-1",
        "pod_uid": "u-1",
        "container": "rank",
    }
    assert oci.identity({}).as_dict() == {"namespace": "", "pod": "", "pod_uid": "", "container": ""}


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["process"]["env"])


def test_edit_adds_the_shim_mounts_env_and_hooks() -> None:
    spec = with_device(containerd_spec())
    original = json.dumps(spec)
    edited = oci.edit_spec(spec, CONFIG, "c1")
    assert json.dumps(spec) == original, "the input must not change"
    env = env_of(edited)
    assert env["LD_PRELOAD"] == "/run/ibckpt/lib/libibckpt.so"
    assert env["IBCKPT_CTL"] == "/run/ibckpt/ctl/%p.sock"
    assert env["IBCKPT_COORD"] == "unix:/run/ibckpt/coord/coord.sock"
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/root"
    mounts = {m["destination"]: m for m in edited["mounts"]}
    assert mounts["/run/ibckpt/lib/libibckpt.so"]["source"] == "/opt/ib/libibckpt.so"
    assert "ro" in mounts["/run/ibckpt/lib/libibckpt.so"]["options"]
    assert "noexec" not in mounts["/run/ibckpt/lib/libibckpt.so"]["options"], "the shim must be mappable"
    assert mounts["/run/ibckpt/ctl"]["source"] == "/run/ibk/containers/c1/ctl"
    assert "rw" in mounts["/run/ibckpt/ctl"]["options"]
    # the container's own coordinator directory, never one shared by the node's containers
    assert mounts["/run/ibckpt/coord"]["source"] == "/run/ibk/containers/c1/coord"
    assert "ro" in mounts["/run/ibckpt/coord"]["options"]
    assert "/proc" in mounts
    for stage in ("createRuntime", "poststop"):
        (hook,) = edited["hooks"][stage]
        assert hook["path"] == "/opt/ib/bin/ibckpt-hook"
        assert hook["args"] == ["ibckpt-hook", stage]
        assert hook["timeout"] > 0


def test_edit_keeps_the_apps_preload_and_is_idempotent() -> None:
    spec = with_device(containerd_spec())
    spec["process"]["env"].append("LD_PRELOAD=/usr/lib/libjemalloc.so /usr/lib/libx.so")
    once = oci.edit_spec(spec, CONFIG, "c1")
    twice = oci.edit_spec(once, CONFIG, "c1")
    assert (
        env_of(twice)["LD_PRELOAD"] == "/run/ibckpt/lib/libibckpt.so:/usr/lib/libjemalloc.so:/usr/lib/libx.so"
    )
    assert twice == once
    assert sum(1 for e in twice["process"]["env"] if e.startswith("LD_PRELOAD=")) == 1


def test_edit_leaves_a_hook_the_engine_injected_from_hooks_d() -> None:
    spec = with_device(containerd_spec())
    spec["hooks"] = {"createRuntime": [{"path": "/usr/local/bin/ibckpt-hook", "args": ["ibckpt-hook"]}]}
    edited = oci.edit_spec(spec, CONFIG, "c1")
    assert edited["hooks"] == spec["hooks"]


def test_edit_passes_a_non_default_config_file_to_the_hook() -> None:
    config = oci.NodeConfig(config_file="/etc/other.json")
    edited = oci.edit_spec(with_device(containerd_spec()), config, "c1")
    assert "IBCKPT_NODE_CONFIG=/etc/other.json" in edited["hooks"]["createRuntime"][0]["env"]


def test_process_owner_maps_user_namespaces() -> None:
    spec = containerd_spec()
    spec["process"]["user"] = {"uid": 1000, "gid": 100}
    assert oci.process_owner(spec) == (1000, 100)
    spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 200000, "size": 65536}]
    spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 300000, "size": 65536}]
    assert oci.process_owner(spec) == (201000, 300100)
    spec["process"]["user"]["uid"] = 70000
    with pytest.raises(ValueError, match="not mapped"):
        oci.process_owner(spec)


def test_checked_id_refuses_paths() -> None:
    assert oci.checked_id("abc-1.2_3+x") == "abc-1.2_3+x"
    for bad in ("", ".", "..", "a/b", "../x", "a b", "a\n"):
        with pytest.raises(ValueError):
            oci.checked_id(bad)


def test_load_config(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"runc": "/x/runc", "state_dir": "/s", "registry_timeout_s": 2}))
    config = oci.load_config({"IBCKPT_NODE_CONFIG": str(path)})
    assert (config.runc, config.state_dir, config.registry_timeout_s) == ("/x/runc", "/s", 2.0)
    assert config.registry_socket == "/s/registry.sock"
    assert config.shim == oci.NodeConfig().shim
    path.write_text(json.dumps({"runc": "/x", "typo": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        oci.load_config({"IBCKPT_NODE_CONFIG": str(path)})
    path.write_text(json.dumps({"registry_timeout_s": "1"}))
    with pytest.raises(ValueError, match="registry_timeout_s"):
        oci.load_config({"IBCKPT_NODE_CONFIG": str(path)})
    with pytest.raises(ValueError, match="no such file"):
        oci.load_config({"IBCKPT_NODE_CONFIG": str(tmp_path / "missing.json")})


BUILD = "ab" * 32  # a sha256 in hex
OLDER = "cd" * 32


def test_the_edit_mounts_the_content_addressed_build_node_json_names() -> None:
    current = f"/usr/local/lib/ibckpt/builds/{BUILD}/libibckpt.so"
    config = oci.NodeConfig(shim=current, hook="/opt/ib/bin/ibckpt-hook", state_dir="/run/ibk")
    edited = oci.edit_spec(with_device(containerd_spec()), config, "c1")
    assert oci.shim_source(edited) == current
    assert oci.build_of(oci.shim_source(edited) or "") == BUILD
    # a restore mounts the build its checkpoint recorded, kept beside the current one
    older = oci.build_path(current, OLDER)
    assert older == f"/usr/local/lib/ibckpt/builds/{OLDER}/libibckpt.so"
    assert oci.shim_source(oci.edit_spec(with_device(containerd_spec()), config, "c1", older)) == older


def test_only_a_content_addressed_path_names_a_build() -> None:
    assert oci.build_of("/usr/local/lib/ibckpt/libibckpt.so") is None
    assert oci.build_of(f"/x/builds/{BUILD}/other.so") is None
    assert oci.build_of(f"/x/builds/{BUILD.upper()}/libibckpt.so") is None
    assert oci.build_of(f"/x/elsewhere/{BUILD}/libibckpt.so") is None
    # a node whose node.json still names the file of a release before builds: builds/ beside it
    assert oci.build_path("/usr/local/lib/ibckpt/libibckpt.so", BUILD) == (
        f"/usr/local/lib/ibckpt/builds/{BUILD}/libibckpt.so"
    )
    with pytest.raises(ValueError, match="not a shim build"):
        oci.build_path("/usr/local/lib/ibckpt/libibckpt.so", "../../etc")
