"""Install the hook, the runtime handler and the shim onto a node (the agent's init step).

    python -m ibckpt_node.hook.install [--root /host] [--prefix /usr/local] [--shim FILE]
        [--python /usr/bin/python3] [--config JSON]

The runtime runs the hook and the wrapper in the node's own filesystem, not in the agent's
image, and on every container create. So they go in as a copy of this package (standard library
only) under PREFIX/lib/ibckpt/python, with launchers PREFIX/bin/ibckpt-hook and
PREFIX/bin/ibckpt-runc that start the node's python with -I -S: no site-packages scan, no
user environment, about 10 ms faster than a console script in a virtualenv. ibckpt-runc is a
shell script that starts Python only for create, run and start.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = ("__init__.py", "oci.py", "client.py", "main.py", "stages.py", "runc.py", "restore.py", "unpack.py")


def launcher(python: str, libdir: str, module: str) -> str:
    return (
        f"#!{python} -IS\n"
        "import sys\n"
        f"sys.path.insert(0, {libdir!r})\n"
        f"from {module} import main\n"
        "sys.exit(main())\n"
    )


def runc_launcher(python: str, libdir: str, runc: str) -> str:
    """ibckpt-runc as a shell script: only a call naming create, run or start may need the wrapper's
    Python (runc.main passes every other one through); the rest go straight to runc. containerd
    bounds a task's delete at 10 s, and on a loaded node Python's start alone took seconds of that."""
    code = (
        f"import sys; sys.path.insert(0, {json.dumps(libdir)}); from ibckpt_node.hook.runc import main; "
        f"sys.exit(main(default_runc={json.dumps(runc)}))"
    )
    return (
        "#!/bin/sh\n"
        "# ibckpt-runc: runc for the ibckpt runtime handler (ibckpt_node.hook.runc)\n"
        'for arg in "$@"; do\n'
        "  case $arg in\n"
        f'    create|run|start) exec {shlex.quote(python)} -IS -c {shlex.quote(code)} "$@" ;;\n'
        "  esac\n"
        "done\n"
        "runc=${IBCKPT_RUNC:-}\n"
        f'[ -n "$runc" ] || runc={shlex.quote(runc)}\n'
        'exec "$runc" "$@"\n'
    )


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)  # atomic: a create running now sees the old file or the new one


def install_shim(shim: Path, dest: Path) -> bool:
    """Install the shim unless the same one is there; whether it was written.

    The same shim keeps its file: each container of the RuntimeClass bind-mounts it, so a new file under
    running containers leaves their processes mapping a deleted one, and CRIU cannot restore such a
    mapping where the new file now is ("Can't re-create deleted file"). Every agent restart did that
    before. A different shim (an upgrade) is a new file, swapped in atomically; containers started before
    keep the old one: docs/runtime-hook.md, "Upgrading the shim"."""
    if dest.exists() and filecmp.cmp(shim, dest, shallow=False):
        return False
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(shim, tmp)
    tmp.chmod(0o644)
    tmp.replace(dest)
    return True


def install(
    root: Path, prefix: str, python: str, shim: Path | None, config: dict[str, object] | None
) -> None:
    top = root / prefix.lstrip("/")
    libdir = f"{prefix}/lib/ibckpt/python"
    pkg = root / libdir.lstrip("/") / "ibckpt_node"
    (pkg / "hook").mkdir(parents=True, exist_ok=True)
    _write(pkg / "__init__.py", '"""ibckpt_node: the node-side hook only (installed copy)."""\n', 0o644)
    for name in MODULES:
        _write(pkg / "hook" / name, (HERE / name).read_text(), 0o644)
    (top / "bin").mkdir(parents=True, exist_ok=True)
    runc = str((config or {}).get("runc", "/usr/sbin/runc"))
    # the wrapper passes most calls through without reading node.json: it gets runc here
    _write(top / "bin" / "ibckpt-runc", runc_launcher(python, libdir, runc), 0o755)
    _write(top / "bin" / "ibckpt-hook", launcher(python, libdir, "ibckpt_node.hook.main"), 0o755)
    if shim is not None:
        install_shim(shim, top / "lib" / "ibckpt" / "libibckpt.so")
    if config is not None:
        etc = root / "etc" / "ibckpt"
        etc.mkdir(parents=True, exist_ok=True)
        _write(etc / "node.json", json.dumps(config, indent=2) + "\n", 0o644)


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m ibckpt_node.hook.install"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/", help="the node's / as this process sees it")
    parser.add_argument("--prefix", default="/usr/local")
    parser.add_argument("--python", default="/usr/bin/python3", help="the node's python3 (>= 3.9)")
    parser.add_argument("--shim", type=Path, help="libibckpt.so to install as PREFIX/lib/ibckpt/libibckpt.so")
    parser.add_argument("--config", help="JSON object to write as /etc/ibckpt/node.json")
    args = parser.parse_args(argv)
    config = json.loads(args.config) if args.config else None
    install(Path(args.root), args.prefix, args.python, args.shim, config)
    print(f"installed under {os.path.join(args.root, args.prefix.lstrip('/'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
