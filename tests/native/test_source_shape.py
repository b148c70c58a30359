"""The shim stays easy to read (issue 16): no C file much over 600 lines, no include cycle, and
the control side depends one way (socket -> commands -> phases -> ibckpt.h hooks)."""

from __future__ import annotations

import re

from shimtest import NATIVE_DIR

SRC = NATIVE_DIR / "src"
PHASES = ("quiesce.c", "drain.c", "release.c", "rebuild.c", "report.c", "lease.c")


def test_no_c_file_over_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in SRC.glob("*.[ch]")}
    assert {n: s for n, s in sizes.items() if s > 600} == {}


def test_no_include_cycle() -> None:
    headers = {q.name for q in SRC.glob("*.h")}
    include = re.compile(r'^#include "([^"]+)"', re.M)
    graph = {p.name: set(include.findall(p.read_text())) & headers for p in SRC.glob("*.h")}

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, " -> ".join((*path, node))
        for nxt in graph.get(node, ()):
            visit(nxt, (*path, node))

    for h in graph:
        visit(h, ())


def _calls(name: str) -> str:
    return (SRC / name).read_text()


def test_control_depends_one_way() -> None:
    # the ibckpt.h side knows nothing of the commands or the phases
    assert not re.search(r"\bibk_(do_|command_|control_|phase_)", _calls("api.c"))
    # the phases do not call back into the commands or the socket
    for f in PHASES:
        assert not re.search(r"\bibk_command_reply\b|\bibk_control_ensure\b|\bibckpt_control\b", _calls(f)), f
    # the socket reaches the commands only through ibk_command_reply
    assert not re.search(r"\bibk_do_\w+\(", _calls("control.c"))
