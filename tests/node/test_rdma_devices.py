"""Host tests of a container's RDMA devices (ibckpt_node.rdma_devices, agent/restoredevices.py): what a
checkpoint records from the OCI spec, sysfs and the shims' status, and the maps a restore sends before
its ranks rebuild, against stand-in shims (fake_shim.py); with the driver's restore, the maps come
before the rebuild and a refusal rebuilds no rank."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from node.fake_shim import FakeShimSocket

from ibckpt.coordination.client import CoordinatorClient
from ibckpt.coordination.ranks import RankId
from ibckpt.devicemap import DeviceMapError
from ibckpt.vocabulary import PhaseSeconds
from ibckpt_node import agent_cli, rdma_devices
from ibckpt_node.agent import restoredevices
from ibckpt_node.agent.restoredevices import DeviceRestoreError, Recorded
from ibckpt_node.container_runtime import RuntimeContainer
from ibckpt_node.driver import NodeDriver
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import RegisteredContainer
from testbed.coordinator import ThreadedCoordinator
from testbed.tlsfiles import shared_pki

KEY = "ring/ring-0/main/7"


class DeviceShim(FakeShimSocket):
    """A shim whose status lists verbs contexts; `knows_devmap` False answers as a shim from before."""

    def __init__(self, path: Path, contexts: list[str], knows_devmap: bool = True) -> None:
        super().__init__(path)
        self.contexts = contexts
        self.knows_devmap = knows_devmap

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        if verb == "status":
            listed = [{"device": name, "index": i} for i, name in enumerate(self.contexts)]
            return True, {"state": self.state, "gids": [], "qps": [], "contexts": listed}
        if verb == "devmap":
            if not self.knows_devmap:
                return False, {"error": "unknown command"}
            return True, {"phase": "devmap", "ok": True, "state": self.state}
        return super().answer(verb)


def sysfs(root: Path, devices: dict[str, str]) -> Path:
    """A /sys/class/infiniband_verbs with uverbsN -> ibdev."""
    for node, name in devices.items():
        (root / node).mkdir(parents=True)
        (root / node / "ibdev").write_text(name + "\n")
    return root


def spec(*nodes: str, mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices = [{"path": f"/dev/infiniband/{n}", "type": "c"} for n in nodes]
    devices.append({"path": "/dev/infiniband/rdma_cm", "type": "c"})
    return {"linux": {"devices": devices}, "mounts": mounts or [{"destination": "/dev", "type": "tmpfs"}]}


def container(tmp_path: Path, config: dict[str, Any], uid: str = "uid-1") -> RegisteredContainer:
    """A registered container whose runtime record names a bundle with `config` as its spec."""
    bundle, control = tmp_path / f"bundle-{uid}", tmp_path / f"ctl-{uid}" / "ctl"
    bundle.mkdir()
    control.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps(config))
    record = {"runc": "runc", "root": "/run/runc", "bundle": str(bundle)}
    (control.parent / "runtime.json").write_text(json.dumps(record))
    return RegisteredContainer(
        container_id=f"c-{uid}", namespace="team", pod="ring-0", pod_uid=uid, container="main", pid=4242,
        pid_start=1, control_dir=str(control), control_socket=str(control / "7.sock"), shim=True,
        registered_at=1.0,
    )  # fmt: skip


def test_the_allocation_is_the_specs_uverbs_nodes_in_order(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_0", "uverbs1": "mlx5_1", "uverbs2": "mlx5_2"})
    assert rdma_devices.allocation(spec("uverbs2", "uverbs0"), sys) == (["mlx5_2", "mlx5_0"], False)
    assert rdma_devices.allocation(spec(), sys) == ([], False)
    assert rdma_devices.allocation(None, sys) is None


def test_a_whole_dev_infiniband_mount_is_the_nodes_devices(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs10": "rxe1", "uverbs2": "rxe0"})
    hostpath = [{"destination": "/dev/infiniband", "type": "bind", "source": "/dev/infiniband"}]
    assert rdma_devices.allocation(spec(mounts=hostpath), sys) == (["rxe0", "rxe1"], True)


def test_a_checkpoint_records_each_trees_devices_from_spec_and_status(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_0", "uverbs1": "mlx5_1"})
    shim = DeviceShim(tmp_path / "7.sock", ["mlx5_1", "mlx5_0"])
    entry = container(tmp_path, spec("uverbs1", "uverbs0"))
    runtime = RuntimeContainer.recorded(entry.container_id, Path(entry.control_dir).parent)
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    found = asyncio.run(
        rdma_devices.record([("ring-0.main", runtime)], {"ring-0.main": [KEY]}, [rank], 5, sys)
    )
    assert found == {
        "ring-0.main": {
            "allocated": ["mlx5_1", "mlx5_0"],
            "whole_node": False,
            "used": {KEY: ["mlx5_1", "mlx5_0"]},
        }
    }


def recorded(uid: str = "uid-2") -> Recorded:
    return Recorded(
        "team/ring-0 container main", uid, "main", ("mlx5_0", "mlx5_1"), {KEY: ["mlx5_1", "mlx5_0"]}
    )


def test_a_restore_sends_the_renames_by_position(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_4", "uverbs1": "mlx5_5"})
    shim = DeviceShim(tmp_path / "7.sock", [])
    entry = container(tmp_path, spec("uverbs1", "uverbs0"), "uid-2")  # given mlx5_5, then mlx5_4
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    asyncio.run(restoredevices.apply([recorded()], [entry], [rank], None, 5, sys))
    assert shim.lines == ["devmap -", "devmap mlx5_0 mlx5_5", "devmap mlx5_1 mlx5_4"]


def test_the_requests_explicit_map_wins(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_0", "uverbs1": "mlx5_1"})
    shim = DeviceShim(tmp_path / "7.sock", [])
    entry = container(tmp_path, spec("uverbs0", "uverbs1"), "uid-2")
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    swap = {"mlx5_0": "mlx5_1", "mlx5_1": "mlx5_0"}
    asyncio.run(restoredevices.apply([recorded()], [entry], [rank], swap, 5, sys))
    assert shim.lines == ["devmap -", "devmap mlx5_0 mlx5_1", "devmap mlx5_1 mlx5_0"]


def test_unchanged_names_send_nothing_so_an_old_shim_restores(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_1", "uverbs1": "mlx5_0"})
    shim = DeviceShim(tmp_path / "7.sock", [], knows_devmap=False)
    entry = container(tmp_path, spec("uverbs0", "uverbs1"), "uid-2")  # the same two, in the other order
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    asyncio.run(restoredevices.apply([recorded()], [entry], [rank], None, 5, sys))
    assert shim.lines == []


def test_an_old_shim_that_must_rename_fails_the_restore_readably(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_4", "uverbs1": "mlx5_5"})
    shim = DeviceShim(tmp_path / "7.sock", [], knows_devmap=False)
    entry = container(tmp_path, spec("uverbs0", "uverbs1"), "uid-2")
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    with pytest.raises(DeviceRestoreError, match="refused its device map"):
        asyncio.run(restoredevices.apply([recorded()], [entry], [rank], None, 5, sys))


def test_too_few_devices_refuse_before_any_rank_is_told(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_4"})
    shim = DeviceShim(tmp_path / "7.sock", [])
    entry = container(tmp_path, spec("uverbs0"), "uid-2")
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    with pytest.raises(DeviceRestoreError) as refused:
        asyncio.run(restoredevices.apply([recorded()], [entry], [rank], None, 5, sys))
    message = str(refused.value)
    assert "team/ring-0 container main, rank ring/ring-0/main/7" in message
    assert "device mlx5_1 (position 1 of mlx5_0, mlx5_1) has no counterpart" in message
    assert "the container was given mlx5_4" in message
    assert shim.lines == []


def test_a_checkpoint_without_recorded_devices_maps_nothing(tmp_path: Path) -> None:
    shim = DeviceShim(tmp_path / "7.sock", [])
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    asyncio.run(restoredevices.apply([], [], [rank], None, 5, tmp_path / "none"))
    assert shim.lines == []


async def restore_with_maps(
    coordinator: ThreadedCoordinator, tmp_path: Path, pid: int, given: list[str]
) -> tuple[DeviceShim, NodeDriver, BaseException | None]:
    """One node's restore as the agent runs it (agent/restoring.py): once the runtime restored the
    container, its ranks get their device maps, then the driver rebuilds and resumes them."""
    sys = sysfs(tmp_path / "sys", {f"uverbs{i}": name for i, name in enumerate(given)})
    shim = DeviceShim(tmp_path / "7.sock", [])
    shim.state = "released"  # as a restore brings a rank back
    entry = container(tmp_path, spec(*(f"uverbs{i}" for i in range(len(given)))), "uid-2")
    rank = LocalRank(RankId.parse(KEY), pid, shim.path)
    session, tokens = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-1", tokens["node-1"], tls=shared_pki().client()
    )
    driver = NodeDriver("node-1", client, [], PhaseSeconds(rebuild_seconds=10))

    async def restored() -> list[LocalRank]:
        await restoredevices.apply([recorded()], [entry], [rank], None, 5, sys)
        return [rank]

    try:
        await asyncio.wait_for(driver.rebuild_restored(restored, epoch=2), 30)
        failure = None
    except Exception as exc:
        failure = exc
    finally:
        await client.close()
    return shim, driver, failure


async def test_the_maps_reach_each_rank_before_its_rebuild(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shim, driver, failure = await restore_with_maps(coordinator, tmp_path, sleeper, ["mlx5_4", "mlx5_5"])
    assert failure is None and driver.report.outcome == "Succeeded"
    sent = [line.split()[0] for line in shim.lines]
    assert shim.lines[:3] == ["devmap -", "devmap mlx5_0 mlx5_4", "devmap mlx5_1 mlx5_5"]
    assert sent.index("rebuild") > 2 and sent[-1] == "resume"


async def test_a_refused_map_fails_the_restore_before_any_rank_rebuilds(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    shim, driver, failure = await restore_with_maps(coordinator, tmp_path, sleeper, ["mlx5_4"])
    assert isinstance(failure, DeviceRestoreError), failure
    assert "device mlx5_1 (position 1 of mlx5_0, mlx5_1) has no counterpart" in str(failure)
    assert driver.report.outcome == "Aborted"
    assert "rebuild" not in [line.split()[0] for line in shim.lines] and shim.state == "released"


# `ibckpt-node restore --device-map`, the plain path (no Kubernetes): the same rule, this node's devices
# as the allocation, the map checked before anything is restored.


def test_the_plain_paths_map_renames_what_it_names_and_keeps_the_rest(tmp_path: Path) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_1", "uverbs1": "mlx5_4"})
    shim = DeviceShim(tmp_path / "7.sock", ["mlx5_0", "mlx5_1"])
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    asyncio.run(rdma_devices.map_by_hand([rank], {"mlx5_0": "mlx5_4"}, 5, sys))
    assert shim.lines == ["status", "devmap -", "devmap mlx5_0 mlx5_4"]  # mlx5_1 is here: kept


def test_the_plain_paths_map_refuses_a_device_with_no_counterpart_before_telling_any_rank(
    tmp_path: Path,
) -> None:
    sys = sysfs(tmp_path / "sys", {"uverbs0": "mlx5_4"})
    shim = DeviceShim(tmp_path / "7.sock", ["mlx5_0", "mlx5_2"])
    rank = LocalRank(RankId.parse(KEY), 4242, shim.path)
    with pytest.raises(DeviceMapError) as refused:
        asyncio.run(rdma_devices.map_by_hand([rank], {"mlx5_0": "mlx5_4"}, 5, sys))
    assert f"rank {KEY}: device mlx5_2 (no recorded allocation) has no counterpart" in str(refused.value)
    assert "--device-map OLD=NEW" in str(refused.value) and shim.lines == ["status"]


def test_ibckpt_node_refuses_a_map_to_a_device_this_node_lacks_before_restoring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shim = DeviceShim(tmp_path / "7.sock", ["rxe0"])
    images = tmp_path / "images"  # never read: the refusal comes first
    args = ["restore", "--coordinator", "127.0.0.1:1", "--session", "s", "--node", "node-1",
            "--rank", f"{KEY}={images}:{shim.path}", "--device-map", "rxe0=nowhere7"]  # fmt: skip
    assert agent_cli.main(args) == 2
    said = capsys.readouterr().err
    assert "restore refused: --device-map names nowhere7, not among this node's" in said, said
    assert shim.lines == [] and not images.exists()
    with pytest.raises(SystemExit) as bad:
        agent_cli.main([*args[:-1], "rxe0"])
    assert bad.value.code == 2 and "expected OLD=NEW" in capsys.readouterr().err


async def test_the_plain_restore_asks_before_rebuild_ahead_of_any_rebuild(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    """driver.restore's hook (what --device-map sends through) runs after CRIU, before any rebuild, and
    gets the restored ranks only: a rank that stayed (a Hold's, rejoining) keeps its devices."""
    shim = DeviceShim(tmp_path / "7.sock", ["rxe0"])
    shim.state = "released"
    held = LocalRank(RankId.parse(KEY), sleeper, shim.path)
    session, tokens = coordinator.create_session({"node-1"})
    client = await CoordinatorClient.connect(
        "127.0.0.1", coordinator.port, session, "node-1", tokens["node-1"], tls=shared_pki().client()
    )
    driver = NodeDriver("node-1", client, [], PhaseSeconds(rebuild_seconds=10))
    seen: list[tuple[list[str], list[str]]] = []

    async def before_rebuild(restored: Sequence[LocalRank]) -> None:
        seen.append(([r.rank.key() for r in restored], [line.split()[0] for line in shim.lines]))

    try:
        report = await asyncio.wait_for(driver.restore({}, {}, 2, [held], before_rebuild=before_rebuild), 30)
    finally:
        await client.close()
    assert report.outcome == "Succeeded" and len(seen) == 1
    restored, said_before = seen[0]
    assert restored == [] and "rebuild" not in said_before
    assert "rebuild" in [line.split()[0] for line in shim.lines]
