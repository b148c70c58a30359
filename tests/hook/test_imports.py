"""The hook and the wrapper run on every container create: they must import next to nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "runtime-hook"


def loaded_by(*modules: str) -> set[str]:
    """What importing modules adds to a fresh `python3 -IS` (as the installed launchers start),
    apart from ibckpt_node itself."""
    code = (
        f"import sys\nsys.path.insert(0, {str(LIB)!r})\nbefore = set(sys.modules)\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(["/usr/bin/python3", "-IS", "-c", code], capture_output=True, text=True, check=True)
    return {m for m in out.stdout.split() if m.split(".")[0] != "ibckpt_node"}


# os and what it needs (python -S does not load it: site would)
OS = {"os", "os.path", "posixpath", "genericpath", "stat", "_stat", "_collections_abc"}


def test_the_fast_paths_import_nothing_else() -> None:
    # ibckpt-hook for a container that is not ours, ibckpt-runc passing a call through
    assert loaded_by("ibckpt_node.hook.main") <= {"__future__", *OS}
    assert loaded_by("ibckpt_node.hook.runc") <= {"__future__", *OS}


def test_the_full_path_stays_in_the_cheap_standard_library() -> None:
    loaded = loaded_by("ibckpt_node.hook.stages", "ibckpt_node.hook.restore", "ibckpt_node.hook.runc")
    assert {"json", "socket"} <= loaded, loaded  # the probe works
    heavy = {"typing", "dataclasses", "inspect", "asyncio", "pydantic", "ibckpt", "ibckpt_native", "shutil"}
    assert not loaded & heavy, loaded & heavy


def test_the_unpack_of_a_restore_uses_the_standard_library_alone() -> None:
    """hook/unpack.py runs only for a restore with files to carry (it may load tarfile), and only the
    standard library: the hook's copy on the node has nothing else."""
    loaded = loaded_by("ibckpt_node.hook.unpack")
    code = "import sys; print(' '.join(sorted(sys.stdlib_module_names)))"
    stdlib = set(
        subprocess.run(["/usr/bin/python3", "-IS", "-c", code], capture_output=True, text=True).stdout.split()
    )
    assert "tarfile" in loaded, loaded  # the probe works
    assert {m for m in loaded if m.split(".")[0] not in stdlib} == set()
