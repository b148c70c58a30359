"""Virtual QPNs kept apart between the ranks one node rebuilds (runtime-hook/ibckpt_node/qpn_reserve.py):
the pure plan, and the preflight's refusal of two ranks that already name one QP. The reserve commands
a rebuild sends are checked on a real driver in test_record_confinement.py, and their effect on a real
shim over rxe in tests/native/test_reserve_guest.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.driver_harness import gather_closing, session_clients
from node.test_preflight import GID_A, GID_B, StatusShim

from ibckpt.agentapi import Mode
from ibckpt.coordination.ranks import RankId
from ibckpt_native.control import ShimStatus
from ibckpt_node.driver import NodeDriver
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.qpn_reserve import MAX_RUN, plan, runs
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator

UNSET = "0" * 32


def status(gids: list[str], qpns: list[int]) -> dict[str, Any]:
    return {"state": "running", "gids": gids, "qps": [{"qpn": q, "type": 2} for q in qpns]}


def parsed(gids: list[str], qpns: list[int]) -> ShimStatus:
    return ShimStatus.parse(status(gids, qpns))


def test_runs_collapse_consecutive_qpns_and_stay_within_one_command() -> None:
    assert runs([]) == []
    assert runs([9, 7, 8, 8, 20, 21, 40]) == [(7, 3), (20, 2), (40, 1)]
    assert runs(range(1, MAX_RUN + 3)) == [(1, MAX_RUN), (MAX_RUN + 1, 2)]


def test_each_rank_is_given_the_qpns_of_the_others_that_share_one_of_its_gids() -> None:
    found = plan({
        "a": parsed([GID_A, UNSET], [17, 18]),  # restored from node A
        "b": parsed([GID_A], [19, 30]),  # its sibling from node A
        "c": parsed([GID_B, UNSET], [17]),  # from node B: its 17 is another QP's number, no matter
        "d": parsed([GID_A, GID_B], [40]),  # holds both GIDs: everyone's
    })  # fmt: skip
    assert found.clashes == []
    assert found.reserved == {
        "a": [(19, 1), (30, 1), (40, 1)],
        "b": [(17, 2), (40, 1)],
        "c": [(40, 1)],  # the all-zero GID entries are unset table slots, not shared
        "d": [(17, 3), (30, 1)],
    }


def test_two_ranks_naming_one_qp_are_a_clash() -> None:
    found = plan({"a": parsed([GID_A], [17, 18]), "b": parsed([GID_A], [18]), "c": parsed([GID_B], [18])})
    assert found.clashes == [f"a and b both hold virtual QP {GID_A}/18"]


async def test_the_preflight_refuses_two_ranks_that_name_one_qp_before_any_is_gated(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    """Their rebuild would publish one record for both: peers would reach one of them only."""
    shims = [
        StatusShim(tmp_path / f"r{i}.ctl", {**status([GID_A], [17 + i, 30]), "peers": []}) for i in range(2)
    ]
    ranks = [LocalRank(RankId.parse(f"job/rank-{i}/main/0"), sleeper, s.path) for i, s in enumerate(shims)]
    clients = await session_clients(coordinator, ("node-1",))
    driver = NodeDriver("node-1", clients[0], ranks)
    (result,) = await gather_closing(clients, driver.checkpoint(Mode.STOP, tmp_path / "img", 2), timeout=30)
    assert isinstance(result, CheckpointRefused), result
    assert f"job/rank-0/main/0 and job/rank-1/main/0 both hold virtual QP {GID_A}/30" in str(result)
    assert all(s.commands == ["status"] for s in shims), [s.commands for s in shims]
    assert driver.report.outcome == "Refused"
