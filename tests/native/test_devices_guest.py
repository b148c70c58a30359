"""Several devices per process (issue 30, item 2; native/src/devmap.c, docs/native-shim.md): a pyverbs
program opens both Soft-RoCE devices of the guest, as multi-rail NCCL or UCX do, and moves data over
each (pv_two_hcas.py). Between the shim's release and its rebuild the test renames, swaps and deletes
devices, as a restore onto another node's HCAs may present them, and each context must reopen by the
rule: the node agent's `devmap`, else its device's name, else its index in the device list, else the
rebuild is refused before anything is opened. Where a context really is afterwards is read from its
real GIDs in `status`: each device's netdev has an address of its own (10.77.0.N, 10.78.0.N)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ibckpt_native.control import ControlError, ShimStatus, lines
from shimtest import SHIM, SHIM_ASAN, SHIM_UBSAN
from shimtest.coordinator import Coordinator
from shimtest.harness import ShimProc

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("built")]

INIT = Path(__file__).resolve().parents[1] / "testbed" / "guest-init2.sh"
NODE = os.environ.get("IBCKPT_NODE", "1")
HOME = {"roce0": "rxe0", "roce1": "rxe1"}  # each netdev's device, as the guest makes them
ADDR = {"roce0": f"10.77.0.{NODE}", "roce1": f"10.78.0.{NODE}"}
MOVED = 2 * 2 * 256  # bytes of one round on two devices (pv_two_hcas.py's MSG both ways)


def _sh(*argv: str) -> str:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"{argv}: {run.stdout}{run.stderr}"
    return run.stdout


def _devices() -> dict[str, str]:
    """Each RDMA device's name and its netdev (the one its first GID is on)."""
    ib = Path("/sys/class/infiniband")
    return {d.name: (d / "ports/1/gid_attrs/ndevs/0").read_text().strip() for d in sorted(ib.iterdir())}


def _wait_device(name: str) -> None:
    """Until device `name` is there with its uverbs node, to be opened."""

    def ready() -> bool:
        for verbs in Path("/sys/class/infiniband_verbs").glob("uverbs*"):
            if (verbs / "ibdev").read_text().strip() == name and Path(
                f"/dev/infiniband/{verbs.name}"
            ).exists():
                return True
        return False

    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, f"no {name}: {_devices()}"
        time.sleep(0.05)


def _rename(old: str, new: str) -> None:
    _sh("rdma", "dev", "set", old, "name", new)


def _restore(made: bool) -> None:
    """The guest as it was: rxe0 on roce0, rxe1 on roce1 (or no second device if the test made it)."""
    if "roce1" not in _devices().values() and not made:
        _sh("rdma", "link", "add", "rxe1", "type", "rxe", "netdev", "roce1")
        _wait_device("rxe1")
    # each device first to a name nobody wants, so that no rename meets a name still taken
    for i, (name, netdev) in enumerate(_devices().items()):
        if name != HOME[netdev]:
            _rename(name, f"ibkfix{i}")
    for name, netdev in _devices().items():
        if name != HOME[netdev]:
            _rename(name, HOME[netdev])
    if made:
        if "rxe1" in _devices():
            _sh("rdma", "link", "delete", "rxe1")
        _sh("ip", "link", "delete", "roce1")


@pytest.fixture
def two_devices() -> Iterator[None]:
    """rxe0 on roce0 and rxe1 on roce1. A guest booted with ibckpt.devices=2 has both; in one booted
    without (the session's guest), the second is made by guest-init2.sh's own second_device, and
    taken away again after the test. Names the test changed are put back, a device it deleted made
    again."""
    made = "rxe1" not in _devices()
    if made:
        _sh("bash", "-c", f'eval "$(sed -n "/^second_device() {{/,/^}}/p" {INIT})" && second_device {NODE}')
    try:
        assert _devices() == {"rxe0": "roce0", "rxe1": "roce1"}
        yield
    finally:
        _restore(made)


def _start(
    tmp_path: Path, coord: Coordinator, *args: str, env: dict[str, str] | None = None, shim: Path = SHIM
) -> ShimProc:
    """pv_two_hcas.py under the shim (args: the devices it opens, all if none), once connected."""
    prog = ShimProc(
        "rails",
        ["/usr/bin/python3", str(Path(__file__).with_name("pv_two_hcas.py")), str(tmp_path), *args],
        tmp_path,
        {**coord.env, "PATH": "/usr/bin:/bin", **(env or {})},
        shim=shim,
    )
    prog.start()
    prog.wait_for_output(r"DEVICES", 120)
    return prog


def _round(prog: ShimProc, n: int, moved: int = MOVED) -> None:
    """One round of traffic on every device, every byte checked by the program."""
    (prog.workdir / f"go{n}").touch()
    got = prog.wait_for_output(rf"ROUND {n} (\d+)|WRONG.*", 120)
    assert got.group(1) is not None and int(got.group(1)) == moved, prog.outputs()


def _release(prog: ShimProc) -> None:
    ctl = prog.ctl
    ctl.quiesce(20000)
    ctl.drain(3000)
    report = ctl.release(10000)
    assert report["ok"] and report["device_fds"] == 0, report


def _rebuild(prog: ShimProc, epoch: int) -> None:
    report = prog.ctl.rebuild(epoch, 60000)
    assert report["ok"], report
    prog.ctl.resume()


def _refused(prog: ShimProc, epoch: int) -> str:
    """A rebuild the shim refuses: its message; the process stays released, nothing opened."""
    with pytest.raises(ControlError) as refused:
        prog.ctl.rebuild(epoch, 60000)
    status = prog.ctl.status()
    assert status["state"] == "released" and all(c["real_gids"] == [] for c in status["contexts"]), status
    return str(refused.value.reply["error"])


def _where(prog: ShimProc) -> list[tuple[str, int, str]]:
    """Each context (oldest first): its device's name and index as the shim reports them, and the
    netdev whose address is among its real GIDs (the device it is really on)."""
    status = prog.ctl.status()
    netdev_of = {"00000000000000000000ffff" + bytes(map(int, a.split("."))).hex(): n for n, a in ADDR.items()}
    where = []
    for c in status["contexts"]:
        on = {netdev_of[g] for g in c["real_gids"] if g in netdev_of}
        assert len(on) == 1, (c, ADDR)
        where.append((c["device"], c["index"], on.pop()))
    assert ShimStatus.parse(status).contexts == tuple((d, i) for d, i, _ in where)
    return where


def _devmap(prog: ShimProc, old: str | None, new: str = "") -> list[dict[str, Any]]:
    reply = prog.ctl.command(lines.devmap(old, new))
    assert reply["phase"] == "devmap" and reply["ok"], reply
    return list(reply["devmap"])


def _stop(prog: ShimProc) -> str:
    (prog.workdir / "stop").touch()
    assert prog.wait(120) == 0, prog.outputs()
    err = prog.err.read_text(errors="replace")
    assert not re.search(r"AddressSanitizer|runtime error|Segmentation", err), err
    return err


@pytest.mark.usefixtures("two_devices")
def test_contexts_follow_their_names_then_their_indices_then_the_map(
    tmp_path: Path, coord: Coordinator
) -> None:
    # IBCKPT_DEVICE names one device for a process on one: with two it must not pull both onto it
    prog = _start(tmp_path, coord, env={"IBCKPT_DEVICE": "rxe1"})
    try:
        _round(prog, 1)
        start = _where(prog)
        assert sorted((d, n) for d, _, n in start) == [("rxe0", "roce0"), ("rxe1", "roce1")], start
        index = {n: i for _, i, n in start}  # each device's place in the list, which renames keep
        assert sorted(index.values()) == [0, 1], start
        home = [n for _, _, n in start]  # the netdev each context started on

        # (i) the same names: each context back on its own device
        _release(prog)
        _rebuild(prog, 1)
        _round(prog, 2)
        assert _where(prog) == start

        # (ii) the names swapped (through a third): each context follows its name to the other device
        _release(prog)
        _rename("rxe0", "ibktmp")
        _rename("rxe1", "rxe0")
        _rename("ibktmp", "rxe1")
        _rebuild(prog, 2)
        _round(prog, 3)
        other = {"roce0": "roce1", "roce1": "roce0"}
        assert _where(prog) == [(HOME[n], index[other[n]], other[n]) for n in home]

        # (iii) both names gone: each context keeps its index, so stays where it is
        _release(prog)
        renamed = {"rxe0": "hca_p", "rxe1": "hca_q"}  # rxe0 is on roce1 now, rxe1 on roce0
        for old, new in renamed.items():
            _rename(old, new)
        _rebuild(prog, 3)
        _round(prog, 4)
        now = {"roce1": "hca_p", "roce0": "hca_q"}
        assert _where(prog) == [(now[other[n]], index[other[n]], other[n]) for n in home]

        # (iv) the agent's map wins over the names there are; two devices onto one is refused first
        _release(prog)
        _devmap(prog, "hca_p", "hca_q")
        assert _devmap(prog, "hca_q", "hca_q") == [
            {"from": "hca_p", "to": "hca_q"},
            {"from": "hca_q", "to": "hca_q"},
        ]
        why = _refused(prog, 4)
        assert "would both reopen on hca_q" in why and "never put on one" in why, why
        assert _devmap(prog, None) == []
        _devmap(prog, "hca_p", "hca_q")
        _devmap(prog, "hca_q", "hca_p")
        _rebuild(prog, 4)
        _round(prog, 5)
        assert _where(prog) == [(now[n], index[n], n) for n in home]  # each on its first device again

        # the map served that rebuild only: the next one goes by the names again
        _release(prog)
        _rebuild(prog, 5)
        _round(prog, 6)
        assert _where(prog) == [(now[n], index[n], n) for n in home]
        err = _stop(prog)
        assert "IBCKPT_DEVICE=rxe1 is not used: this process has contexts on several devices" in err, err
    finally:
        prog.kill()


@pytest.mark.usefixtures("two_devices")
def test_a_device_gone_with_the_names_refuses_the_rebuild(tmp_path: Path, coord: Coordinator) -> None:
    # under ASan: the refusal, and the device lists the shim holds and lets go across it
    prog = _start(tmp_path, coord, shim=SHIM_ASAN)
    try:
        _round(prog, 1)
        start = _where(prog)
        at = {i: d for d, i, _ in start}
        _release(prog)
        # rxe1 deleted, rxe0 renamed: the context at index 1 has neither its name nor its index
        _sh("rdma", "link", "delete", "rxe1")
        _rename("rxe0", "hca_z")
        why = _refused(prog, 1)
        assert f"no device for the context on {at[1]} (index 1)" in why, why
        assert "devices now: hca_z (index 0)" in why, why
        # nothing was opened or changed: with the devices back, the same rebuild goes through
        _rename("hca_z", "rxe0")
        _sh("rdma", "link", "add", "rxe1", "type", "rxe", "netdev", "roce1")
        _wait_device("rxe1")
        _rebuild(prog, 1)
        _round(prog, 2)
        assert sorted((d, n) for d, _, n in _where(prog)) == [("rxe0", "roce0"), ("rxe1", "roce1")]
        _stop(prog)
    finally:
        prog.kill()


@pytest.mark.usefixtures("two_devices")
def test_ibckpt_device_moves_a_process_on_one_device(tmp_path: Path, coord: Coordinator) -> None:
    # as before several devices: IBCKPT_DEVICE names the device a one-device process reopens on
    prog = _start(tmp_path, coord, "rxe0", env={"IBCKPT_DEVICE": "rxe1"}, shim=SHIM_UBSAN)  # and under UBSan
    try:
        _round(prog, 1, MOVED // 2)
        assert [(d, n) for d, _, n in _where(prog)] == [("rxe0", "roce0")]
        _release(prog)
        _rebuild(prog, 1)
        _round(prog, 2, MOVED // 2)
        assert [(d, n) for d, _, n in _where(prog)] == [("rxe1", "roce1")]
        _stop(prog)
    finally:
        prog.kill()
