"""On the host, with no RDMA device: the `devmap` control command (native/src/devmap.c) keeps the
node agent's explicit map of old device names to new ones for the next rebuild, refuses what is not
such a map, and `status` lists each verbs context's device (none here). The agent's side formats the
lines (ibckpt_native.control.lines.devmap, ibckpt_node.devmap) and parses `contexts` strictly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from ibckpt_native.control import ControlError, ShimStatus, checked_phase, lines
from ibckpt_node import devmap
from shimtest import NATIVE_DIR, SHIM, SHIM_ASAN, SHIM_UBSAN

# each line's return code and reply, through the in-process way in (ibckpt.h's ibckpt_control)
PROGRAM = """
import ctypes, json, sys
g = ctypes.CDLL(None)
buf = ctypes.create_string_buffer(1 << 16)
got = []
for line in json.loads(sys.argv[1]):
    rc = g.ibckpt_control(line.encode(), buf, len(buf))
    got.append([rc, json.loads(buf.value)])
print(json.dumps(got))
"""


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt.so", "sanitizers"], check=True)


@pytest.fixture(params=[SHIM, SHIM_ASAN, SHIM_UBSAN], ids=["plain", "asan", "ubsan"])
def preload(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that runs a program under the shim, plain or under a sanitizer."""
    if request.param != SHIM_ASAN:
        return {"LD_PRELOAD": str(request.param)}
    libasan = subprocess.run(  # the ASan runtime must be the first object in the process
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {"LD_PRELOAD": f"{libasan} {SHIM_ASAN}", "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}


def _run(preload: dict[str, str], commands: list[str]) -> list[tuple[int, dict[str, Any]]]:
    env = {"PATH": "/usr/bin:/bin", **preload}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, json.dumps(commands)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [(rc, reply) for rc, reply in json.loads(proc.stdout)]


def test_devmap_keeps_the_agents_pairs_until_emptied(preload: dict[str, str]) -> None:
    sent = [
        "devmap rxe0 mlx5_2",
        "devmap rxe1 mlx5_3",
        "devmap  rxe0\tmlx5_4",
        "status",
        "devmap -",
        "status",
    ]
    got = _run(preload, sent)
    assert all(rc == 0 for rc, _ in got), got
    maps = [reply["devmap"] for _, reply in got if reply.get("phase") == "devmap"]
    assert maps == [
        [{"from": "rxe0", "to": "mlx5_2"}],
        [{"from": "rxe0", "to": "mlx5_2"}, {"from": "rxe1", "to": "mlx5_3"}],
        [{"from": "rxe0", "to": "mlx5_4"}, {"from": "rxe1", "to": "mlx5_3"}],  # named again: mapped anew
        [],
    ]
    # the agent acts on it like on any phase reply: it answers devmap and names a state
    checked_phase("devmap rxe0 mlx5_2", got[0][1])
    # no verbs context here: an empty list, parsed as such
    status = got[3][1]
    assert status["contexts"] == [] and ShimStatus.parse(status).contexts == (), status


def test_devmap_refuses_what_is_not_a_map(preload: dict[str, str]) -> None:
    bad = ["devmap", "devmap rxe0", "devmap - rxe0", "devmap a b c", f"devmap {'x' * 64} y",
           f"devmap y {'x' * 64}", "devmap -x"]  # fmt: skip
    for line, (rc, reply) in zip(bad, _run(preload, bad), strict=True):
        assert rc != 0 and "devmap needs <old device> <new device>" in reply["error"], (line, reply)
    # the longest name there is is taken; a name the shim cannot print as is comes back escaped
    got = _run(preload, [f"devmap {'x' * 63} y", 'devmap a"b c\\d'])
    assert [rc for rc, _ in got] == [0, 0], got
    assert got[1][1]["devmap"][1] == {"from": 'a"b', "to": "c\\d"}, got


def test_devmap_holds_64_devices(preload: dict[str, str]) -> None:
    got = _run(preload, [f"devmap d{i} n{i}" for i in range(65)] + ["devmap d3 other", "devmap -"])
    assert all(rc == 0 for rc, _ in got[:64]), got[63]
    assert got[64][0] != 0 and "64 devices at most" in got[64][1]["error"], got[64]
    assert got[65][0] == 0 and got[65][1]["devmap"][3] == {"from": "d3", "to": "other"}
    assert got[66][1]["devmap"] == []


def test_the_agents_lines() -> None:
    assert lines.devmap("rxe0", "mlx5_2") == "devmap rxe0 mlx5_2"
    assert lines.devmap(None) == "devmap -"
    for old, new in (("", "a"), ("a", ""), ("a b", "c"), ("-", "a"), ("a", "x" * 64)):
        with pytest.raises(ValueError):
            lines.devmap(old, new)
    assert devmap.commands({"rxe1": "mlx5_3", "rxe0": "mlx5_2"}) == [
        "devmap -", "devmap rxe0 mlx5_2", "devmap rxe1 mlx5_3"]  # fmt: skip

    class Shim:  # stands in for AsyncShimControl: what the rank's shim would be sent
        def __init__(self) -> None:
            self.sent: list[str] = []

        async def phase(self, line: str, timeout_s: float) -> dict[str, Any]:
            self.sent.append(line)
            return {}

    shim = Shim()
    asyncio.run(devmap.send(shim, {"rxe0": "mlx5_0"}, 5.0))  # type: ignore[arg-type]
    assert shim.sent == ["devmap -", "devmap rxe0 mlx5_0"]


def test_status_contexts_are_parsed_strictly() -> None:
    base: dict[str, Any] = {"state": "running", "gids": [], "qps": []}
    two = [{"device": "rxe0", "index": 0, "gids": [], "real_gids": []}, {"device": "mlx5_1", "index": -1}]
    assert ShimStatus.parse({**base, "contexts": two}).contexts == (("rxe0", 0), ("mlx5_1", -1))
    assert ShimStatus.parse(base).contexts == ()  # a shim from before: nothing said
    for contexts in ([{"device": "", "index": 0}], [{"device": "x" * 64, "index": 0}],
                     [{"device": "rxe0", "index": -2}], [{"device": "rxe0", "index": True}],
                     [{"device": 3, "index": 0}], ["rxe0"], {"rxe0": 0},
                     [{"device": "rxe0", "index": 0}] * 65):  # fmt: skip
        with pytest.raises(ControlError):
            ShimStatus.parse({**base, "contexts": contexts})
