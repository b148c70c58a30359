"""The testbed device plugin's protobuf shapes, against hand-checked bytes of pluginapi v1beta1."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed import rdma_device_plugin as plugin


def test_register_request_fields() -> None:
    fields = plugin.decode(plugin.register_request("x.sock", "rdma/hca"))
    assert fields == [(1, b"v1beta1"), (2, b"x.sock"), (3, b"rdma/hca"), (4, b"")]


def test_allocate_request_gives_each_containers_ids() -> None:
    # AllocateRequest{container_requests: [{devicesIDs: [hca-0, hca-1]}, {devicesIDs: [hca-2]}]}
    first = b"\x0a\x05hca-0" + b"\x0a\x05hca-1"
    second = b"\x0a\x05hca-2"
    request = b"\x0a" + bytes([len(first)]) + first + b"\x0a" + bytes([len(second)]) + second
    assert plugin.allocate_request_ids(request) == [["hca-0", "hca-1"], ["hca-2"]]


def test_allocate_response_lists_device_specs_per_container() -> None:
    response = plugin.allocate_response([["/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"]])
    [(number, container)] = plugin.decode(response)
    assert number == 1 and isinstance(container, bytes)
    specs = [plugin.decode(v) for n, v in plugin.decode(container) if n == 3 and isinstance(v, bytes)]
    assert specs == [
        [(1, b"/dev/infiniband/uverbs0"), (2, b"/dev/infiniband/uverbs0"), (3, b"rw")],
        [(1, b"/dev/infiniband/rdma_cm"), (2, b"/dev/infiniband/rdma_cm"), (3, b"rw")],
    ]


def test_list_and_watch_and_long_varints() -> None:
    ids = [f"hca-{i}" for i in range(40)]
    response = plugin.list_and_watch_response(ids, healthy=False)
    devices = [plugin.decode(v) for _, v in plugin.decode(response) if isinstance(v, bytes)]
    assert [d[0][1] for d in devices] == [i.encode() for i in ids]
    assert {d[1][1] for d in devices} == {b"Unhealthy"}
    assert len(response) > 127  # the list's own lengths are single bytes; a payload this long is not
    assert plugin.decode(plugin._field(7, b"y" * 300)) == [(7, b"y" * 300)]


def test_a_reversing_node_gives_its_hcas_last_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    for n in (0, 1, 10):
        (sysfs / f"uverbs{n}").mkdir(parents=True)
        dev.mkdir(exist_ok=True)
        (dev / f"uverbs{n}").touch()
    (dev / "rdma_cm").touch()
    monkeypatch.setattr(plugin, "SYS_VERBS", sysfs)
    monkeypatch.setattr(plugin, "DEV_DIR", dev)
    names = [p.rpartition("/")[2] for p in plugin.rdma_device_paths()]
    assert names == ["uverbs0", "uverbs1", "uverbs10", "rdma_cm"]  # by index, not by text
    names = [p.rpartition("/")[2] for p in plugin.rdma_device_paths(reverse=True)]
    assert names == ["uverbs10", "uverbs1", "uverbs0", "rdma_cm"]
