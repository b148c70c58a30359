"""A hostile rank among well-behaved ones (review N24): the shim runs in the tenant's process, so its
replies on the control socket are input. Rank 0 here speaks the real wire (a unix socket, one line each
way: fake_shim.py) and answers garbage for one phase; the checkpoint fails with a clear reason and every
other rank is brought back. A `status` that would make the agent publish without bound is refused
before any rank is touched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from node.driver_harness import FakeShim, connected_driver, failed_checkpoint, fake_ranks
from node.fake_shim import FakeShimSocket

from ibckpt.coordination.ranks import RankId
from ibckpt.vocabulary import Mode
from ibckpt_native.control import MAX_STATUS_GIDS, ControlError, ShimStatus, checked_phase
from ibckpt_node import criu, preflight
from ibckpt_node.errors import CheckpointRefused
from ibckpt_node.ranks import LocalRank
from testbed.coordinator import ThreadedCoordinator

GID = "fe80000000000000020000fffe0000{:02x}"


def garbage(phase: str) -> dict[str, str]:
    """Replies to `phase` the agent must not act on, by what is wrong with them."""
    wrong_state = "quiesced" if phase == "resume" else "running"
    return {
        "cut-json": f'ok {{"phase": "{phase}", "ok": tr',
        "not-an-object": "ok [1, 2]",
        "another-phase": 'ok {"phase": "lease", "ok": true, "state": "running"}',
        "ok-not-a-bool": f'ok {{"phase": "{phase}", "ok": "yes", "state": "running"}}',
        "unexpected-state": f'ok {{"phase": "{phase}", "ok": true, "ms": 1, "state": "{wrong_state}"}}',
        "unknown-state": f'ok {{"phase": "{phase}", "ok": true, "state": "dumped"}}',
    }


CASES = [
    pytest.param(phase, line, id=f"{phase}-{kind}")
    for phase in ("quiesce", "drain", "release", "rebuild", "resume")
    for kind, line in garbage(phase).items()
]


def dump_stand_in(pid: int, images: Path, options: object, timeout: float, parent: Path | None) -> None:
    images.mkdir(parents=True)  # CRIU cannot dump on the host: the rebuild and resume come after it


@pytest.mark.parametrize("phase,line", CASES)
async def test_a_rank_answering_garbage_aborts_and_every_other_rank_resumes(
    coordinator: ThreadedCoordinator,
    tmp_path: Path,
    sleeper: int,
    phase: str,
    line: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(criu, "dump", dump_stand_in)
    shims, ranks = fake_ranks(tmp_path, sleeper, FakeShim)
    shims[0].raw_replies[phase] = line
    driver = await connected_driver(coordinator, ranks)
    reason = rf"{phase} of job/rank-0/main/0 \(pid \d+\) failed: .*malformed reply"
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, tmp_path / "images", reason)
    assert driver.report.outcome == "Aborted"
    for s in shims[1:]:
        assert s.state == "running", (s.commands, s.state)
        if phase in ("quiesce", "drain"):  # no node released: each rank runs again where it is
            assert "release" not in s.commands and s.commands[-1] == "abort", s.commands
        elif phase == "release":  # every node had drained: all released (again) and rebuilt together
            assert s.commands[-5:] == ["release", "status", "reserve", "rebuild", "resume"], s.commands
        else:  # rebuilt (or resumed) already: the release is refused, and it resumes as it is
            assert s.commands[-2:] == ["release", "abort"], s.commands
    assert "abort" in shims[0].commands  # the hostile rank is told too


def test_phase_replies_are_checked_against_the_verb_they_answer() -> None:
    good = {"phase": "drain", "ok": True, "ms": 3, "state": "drained", "qps": []}
    assert checked_phase("drain 3000 20", good) is good
    failed = {"phase": "release", "ok": False, "ms": 3, "state": "released", "errors": 1}
    assert checked_phase("release 1000", failed) is failed  # went badly: the driver's to refuse
    assert checked_phase("lease 30000", {"phase": "lease", "ok": True, "state": "drained"})
    for line, reply, why in [
        ("drain 1", {"phase": "drain", "ok": True, "state": "quiesced"}, "leaves the rank drained"),
        ("drain 1", {"phase": "drain", "ok": 1, "state": "drained"}, "not true or false"),
        ("abort", {"phase": "abort", "ok": True, "state": "running", "ms": "1"}, "'ms' is not an integer"),
        ("quiesce 5", {"ok": True, "state": "quiesced"}, "answers phase None"),
    ]:
        with pytest.raises(ControlError, match=why):
            checked_phase(line, reply)


def test_a_status_of_the_wrong_shape_or_over_the_bounds_is_refused() -> None:
    ok = ShimStatus.parse({"state": "running", "gids": [GID.format(1)], "qps": [{"qpn": 7, "type": 2}]})
    assert ok.gids == (GID.format(1),) and ok.qps == ((7, 2),) and ok.state == "running"
    for reply, why in [
        ({"gids": [GID.format(i % 256) for i in range(1000)]}, "1000 entries in 'gids', more than the 64"),
        ({"gids": "fe80"}, "'gids' is not a list"),
        ({"gids": ["fe80::1"]}, "not a GID of 32 hex digits"),
        ({"qps": [{"qpn": -1, "type": 2}]}, "qpn -1, not an integer"),
        ({"qps": [{"qpn": True, "type": 2}]}, "qpn True"),
        ({"qps": [7]}, "an entry of 'qps' has qpn None"),
        ({"peers": [{"qpn": 1, "type": 2, "peer_gid": 5, "peer_qpn": 2}]}, "'peers' holds 5"),
        ({"state": "dumped"}, "state 'dumped' is none of"),
        ({"unsupported": ["x" * 600]}, "'unsupported' holds an entry"),
    ]:
        with pytest.raises(ControlError, match=why):
            ShimStatus.parse(reply)


class StatusShim(FakeShimSocket):
    def __init__(self, path: Path, status: dict[str, Any]) -> None:
        super().__init__(path)
        self.status = status

    def answer(self, verb: str) -> tuple[bool, dict[str, object]]:
        return (True, self.status) if verb == "status" else super().answer(verb)


def status_of(gids: int, qps: int) -> dict[str, Any]:
    return {
        "state": "running",
        "gids": [GID.format(i + 1) for i in range(gids)],
        "qps": [{"qpn": q + 1, "type": 2} for q in range(qps)],
    }


async def refused_preflight(
    coordinator: ThreadedCoordinator, tmp_path: Path, pid: int, statuses: list[dict[str, Any]], match: str
) -> tuple[list[StatusShim], list[str]]:
    """A checkpoint of ranks answering `statuses`, refused in its preflight; (their shims, the keys the
    driver published)."""
    shims = [StatusShim(tmp_path / f"s{i}.ctl", s) for i, s in enumerate(statuses)]
    ranks = [LocalRank(RankId.parse(f"job/rank-{i}/main/0"), pid, s.path) for i, s in enumerate(shims)]
    driver = await connected_driver(coordinator, ranks, job_addrs=["127.0.0.1"])
    published: list[str] = []
    put = driver.client.put

    async def counted(key: str, value: bytes) -> None:
        published.append(key)
        await put(key, value)

    driver.client.put = counted  # type: ignore[method-assign]
    await failed_checkpoint(driver, Mode.LEAVE_RUNNING, tmp_path / "images", match, CheckpointRefused)
    assert driver.report.outcome == "Refused"
    return shims, published


async def test_a_status_listing_a_thousand_gids_is_refused_before_any_put(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    huge = json.loads(json.dumps(status_of(0, 1000)))
    huge["gids"] = [GID.format(i % 255 + 1) for i in range(1000)]  # 61 KB: a million keys once
    shims, published = await refused_preflight(
        coordinator,
        tmp_path,
        sleeper,
        [status_of(1, 4), huge],
        rf"refusing to checkpoint job/rank-1/main/0 \(pid {sleeper}\): its shim's status: .*"
        rf"1000 entries in 'gids', more than the {MAX_STATUS_GIDS} a rank may have",
    )
    assert published == []
    assert [s.commands for s in shims] == [["status"], ["status"]]  # no rank was gated


async def test_a_node_whose_shims_list_too_many_keys_is_refused_before_any_put(
    coordinator: ThreadedCoordinator, tmp_path: Path, sleeper: int
) -> None:
    """Each status within a rank's bounds, the node's sum over MAX_PREFLIGHT_KEYS."""
    per_rank = 64 * (600 + 1)
    ranks = preflight.MAX_PREFLIGHT_KEYS // per_rank + 1
    shims, published = await refused_preflight(
        coordinator,
        tmp_path,
        sleeper,
        [status_of(64, 600)] * ranks,
        rf"preflight keys, more than {preflight.MAX_PREFLIGHT_KEYS}; most from job/rank-0/main/0 "
        rf"\(pid {sleeper}\): 64 GIDs x 600 QPs",
    )
    assert published == []
    assert all(s.commands == ["status"] for s in shims)


def test_a_refusal_shows_a_bounded_number_of_problems() -> None:
    problems = [f"problem {i}" for i in range(5000)]
    text = preflight.refusal("job/rank-0/main/0", 7, problems)
    shown = preflight.SHOWN_PROBLEMS
    assert text.endswith(f"problem {shown - 1}; and {5000 - shown} more")
    assert len(text) < 300
