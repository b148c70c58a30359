"""docs/verbs-api.md records one decision per libibverbs symbol and per inline-verb function
pointer. These host tests hold it to the installed libibverbs and headers and to the built shim:
a new symbol or pointer fails here until someone decides what the shim does with it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from shimtest import NATIVE_DIR, SHIM

ROOT = NATIVE_DIR.parent
TABLE = ROOT / "docs" / "verbs-api.md"
HEADER = Path("/usr/include/infiniband/verbs.h")
EXPORTED = {"interposed", "forwarded", "refused"}
NOT_EXPORTED = {"passthrough", "provider"}
STRUCTS = ("ibv_context_ops", "verbs_context", "ibv_qp_ex", "ibv_cq_ex")


def _libibverbs() -> Path:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"libibverbs\.so\.1 \(libc6,x86-64\) => (\S+)", out)
    assert m, "libibverbs.so.1 is not installed"
    return Path(m.group(1))


def _dynsyms(lib: Path) -> dict[str, set[str]]:
    """Defined dynamic symbols (functions and data), name -> versions."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    syms: dict[str, set[str]] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[1] == "A":
            continue
        name, _, ver = parts[2].replace("@@", "@").partition("@")
        syms.setdefault(name, set()).add(ver)
    return syms


def _rows(section: str) -> list[list[str]]:
    """The table rows under a heading of docs/verbs-api.md, cells stripped of backquotes."""
    text = TABLE.read_text()
    start = text.index(section)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows[1:]  # the header row


def _symbol_table() -> dict[str, tuple[set[str], str]]:
    rows = _rows("## Exported functions of libibverbs")
    return {r[0]: (set(r[1].split(",")), r[2]) for r in rows}


@pytest.fixture(scope="module")
def shim_exports() -> set[str]:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "build/libibckpt.so"], check=True)
    return set(_dynsyms(SHIM))


def test_every_libibverbs_symbol_has_a_decision() -> None:
    installed = _dynsyms(_libibverbs())
    table = _symbol_table()
    assert sorted(set(installed) - set(table)) == [], "symbols with no decision in docs/verbs-api.md"
    assert sorted(set(table) - set(installed)) == [], "rows for symbols libibverbs no longer exports"
    for name, (versions, decision) in table.items():
        assert versions == installed[name], name
        assert decision in EXPORTED | NOT_EXPORTED, (name, decision)


def test_the_shim_exports_what_the_table_says(shim_exports: set[str]) -> None:
    table = _symbol_table()
    missing = sorted(n for n, (_, d) in table.items() if d in EXPORTED and n not in shim_exports)
    caught = sorted(n for n, (_, d) in table.items() if d in NOT_EXPORTED and n in shim_exports)
    assert missing == [], "decided interposed/forwarded/refused, but the shim does not export them"
    assert caught == [], "the shim exports these, but they are for providers or take no verbs object"
    # and the shim exports no verb the table does not know of
    extra = sorted(n for n in shim_exports if n.startswith(("ibv_", "_ibv_", "verbs_")) and n not in table)
    assert extra == []


def test_refused_symbols_refuse_in_the_source() -> None:
    src = "\n".join(p.read_text() for p in (NATIVE_DIR / "src").glob("*.c"))
    for name, (_, decision) in _symbol_table().items():
        if decision == "refused":
            # a body of its own, or one IBK_REFUSED definition (the verb's name after its declaration)
            assert re.search(rf'ibk_unsupported\("{name}\b|IBK_REFUSED\([^"]*"{name}"', src), name


def _header_pointers(struct: str) -> list[str]:
    body = re.search(rf"^struct {struct} \{{(.*?)^\}};", HEADER.read_text(), re.S | re.M)
    assert body, struct
    return re.findall(r"\(\*\s*(\w+)\)\s*\(", body.group(1))


@pytest.mark.parametrize("struct", STRUCTS)
def test_every_inline_function_pointer_has_a_decision(struct: str) -> None:
    rows = _rows(f"### struct {struct}")
    assert [r[0] for r in rows] == _header_pointers(struct)
    for member, decision, _note in rows:
        assert decision in {"shim", "refused", "unset"}, (struct, member)
    where = {"ibv_cq_ex": "cq.c", "ibv_qp_ex": "qp_ex.c"}.get(struct, "context.c")
    src = (NATIVE_DIR / "src" / where).read_text()
    for member, decision, _note in rows:
        # a pointer the table says the shim sets is assigned in the source, and only those
        assigned = re.search(rf"(->|\.){member} = ", src) is not None
        assert assigned == (decision != "unset"), (struct, member, decision)


# ---- librdmacm ---------------------------------------------------------------------------------

CM_DECISIONS = {"interposed", "followed", "library", "refused", "rsocket"}


def _librdmacm() -> Path:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"librdmacm\.so\.1 \(libc6,x86-64\) => (\S+)", out)
    assert m, "librdmacm.so.1 is not installed"
    return Path(m.group(1))


def _cm_table() -> dict[str, tuple[set[str], str]]:
    rows = _rows("### Exported functions of librdmacm")
    return {r[0]: (set(r[1].split(",")), r[2]) for r in rows}


def test_every_librdmacm_function_has_a_decision() -> None:
    installed = {n: v for n, v in _dynsyms(_librdmacm()).items() if not n.startswith("RDMACM_")}
    table = _cm_table()
    assert sorted(set(installed) - set(table)) == [], "librdmacm functions with no decision"
    assert sorted(set(table) - set(installed)) == [], "rows for functions librdmacm no longer exports"
    for name, (versions, decision) in table.items():
        assert versions == installed[name], name
        assert decision in CM_DECISIONS, (name, decision)


def test_the_shim_exports_the_librdmacm_functions_it_interposes(shim_exports: set[str]) -> None:
    table = _cm_table()
    interposed = {n for n, (_, d) in table.items() if d == "interposed"}
    assert {n for n in shim_exports if n.startswith("rdma_")} == interposed
    src = (NATIVE_DIR / "src" / "rdmacm.c").read_text()
    for name, (_, decision) in table.items():
        if decision == "refused":
            assert re.search(rf'ibk_unsupported\("{name}"\)', src), name
