"""Host unit tests: which registered container is the restored one, and staging paths from names."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ibckpt.agentapi import models as api
from ibckpt_node.agent import restoring
from ibckpt_node.registry import RegisteredContainer

KEY = "ring/ring-0/main/7"


class Entries:
    def __init__(self, *entries: RegisteredContainer) -> None:
        self.list = list(entries)

    def entries(self) -> list[RegisteredContainer]:
        return self.list


def entry(uid: str, at: float, control_dir: Path, pod: str = "ring-0") -> RegisteredContainer:
    return RegisteredContainer(
        container_id=f"c-{uid}", namespace="team", pod=pod, pod_uid=uid, container="main", pid=4242,
        pid_start=1, control_dir=str(control_dir), control_socket=str(control_dir / "7.sock"), shim=True,
        registered_at=at,
    )  # fmt: skip


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[Path]:
    """A container's control directory with rank 7's socket in it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "7.sock"))
        yield tmp_path


def planned(uid: str = "") -> list[restoring.ContainerRestore]:
    return [restoring.ContainerRestore(uid, "team", "ring-0", "main", "node-1/ring-0.main", (KEY,))]


def test_a_pod_created_after_staging_is_found_by_name(sockets: Path) -> None:
    tmp_path = sockets
    old, new = entry("old-uid", 100.0, tmp_path), entry("new-uid", 200.0, tmp_path)
    uids: dict[str, str] = {}
    ranks = asyncio.run(
        restoring.wait_for_ranks(Entries(old, new), planned(), lambda p, n: p, 1.0, 150.0, uids)  # type: ignore[arg-type]
    )
    assert [r.rank.key() for r in ranks] == [KEY] and uids == {KEY: "new-uid"}


def test_a_container_registered_before_staging_is_not_the_restored_one(sockets: Path) -> None:
    tmp_path = sockets
    stale = Entries(entry("old-uid", 100.0, tmp_path), entry("x", 300.0, tmp_path, pod="ring-1"))
    with pytest.raises(restoring.RestoreError, match=r"team/ring-0 container main \(not restored yet"):
        asyncio.run(restoring.wait_for_ranks(stale, planned(), lambda p, n: p, 0.3, 150.0))  # type: ignore[arg-type]


def test_a_named_uid_must_match(sockets: Path) -> None:
    tmp_path = sockets
    found = Entries(entry("new-uid", 200.0, tmp_path))
    with pytest.raises(restoring.RestoreError, match="not restored yet"):
        asyncio.run(restoring.wait_for_ranks(found, planned("other"), lambda p, n: p, 0.3))  # type: ignore[arg-type]
    ranks = asyncio.run(restoring.wait_for_ranks(found, planned("new-uid"), lambda p, n: p, 0.3))  # type: ignore[arg-type]
    assert ranks[0].pid == 4242


def test_names_that_are_not_path_components_are_refused() -> None:
    request = api.RestoreRequest.model_validate(
        {
            "sessionId": "s1", "coordinator": "h:1", "sessionToken": "t", "job": "ring",
            "checkpoint": "team/c",
            "images": {"location": {"bucket": "bkt", "credentialsSecretRef": {"name": "s"}},
                       "credentials": {"namespace": "team", "name": "s"},
                       "job": "team/ring", "checkpointId": "c"},
            "ranks": [{"container": "main", "rankKey": KEY, "namespace": "team", "pod": ".."}],
        }
    )  # fmt: skip
    with pytest.raises(restoring.RestoreError, match=r"bad container id '\.\.'"):
        restoring.plan(request, None)  # type: ignore[arg-type]
