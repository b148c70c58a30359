"""Install the hook, the runtime handler and the shim onto a node (the agent's init step).

    python -m ibckpt_node.hook.install [--root /host] [--prefix /usr/local] [--shim FILE]
        [--python /usr/bin/python3] [--config JSON] [--front FILE]

The runtime runs the hook and the wrapper in the node's own filesystem, not in the agent's
image, and on every container create. So they go in as a copy of this package (standard library
only) under PREFIX/lib/ibckpt/python, with launchers under PREFIX/lib/ibckpt/launch that start the
node's python with -I -S: no site-packages scan, no user environment, about 10 ms faster than a
console script in a virtualenv. PREFIX/bin/ibckpt-hook and ibckpt-runc, what the runtime runs, are
the compiled front (native/front, static): a container that is not ours, and a runc call other than
create, run and start, never start Python.

The shim goes in as PREFIX/lib/ibckpt/builds/<sha256>/libibckpt.so, one directory per build, written
once and kept across upgrades: a restored process must map the very build it mapped before
(docs/runtime-hook.md, "Upgrading the shim"). node.json's `shim` names the current build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ibckpt_node.hook import oci

HERE = Path(__file__).resolve().parent
MODULES = ("__init__.py", "oci.py", "client.py", "main.py", "stages.py", "runc.py", "restore.py", "unpack.py")


def launcher(python: str, libdir: str, module: str, call: str = "main()") -> str:
    return (
        f"#!{python} -IS\n"
        "import sys\n"
        f"sys.path.insert(0, {libdir!r})\n"
        f"from {module} import main\n"
        f"sys.exit({call})\n"
    )


def runc_launcher(launch: str, runc: str) -> str:
    """ibckpt-runc as a shell script, where no compiled front is installed: only a call naming create,
    run or start may need the wrapper's Python (runc.main passes every other one through); the rest go
    straight to runc. containerd bounds a task's delete at 10 s, and on a loaded node Python's start
    alone took seconds of that."""
    return (
        "#!/bin/sh\n"
        "# ibckpt-runc: runc for the ibckpt runtime handler (ibckpt_node.hook.runc)\n"
        'for arg in "$@"; do\n'
        "  case $arg in\n"
        f'    create|run|start) exec {shlex.quote(launch)} "$@" ;;\n'
        "  esac\n"
        "done\n"
        "runc=${IBCKPT_RUNC:-}\n"
        f'[ -n "$runc" ] || runc={shlex.quote(runc)}\n'
        'exec "$runc" "$@"\n'
    )


def _write(path: Path, text: str | bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)  # atomic: a create running now sees the old file or the new one


def _link(path: Path, target: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(path)


def install_entry_points(top: Path, prefix: str, python: str, runc: str, front: Path | None) -> None:
    """PREFIX/bin/ibckpt-hook and ibckpt-runc, what the runtime runs. Python's launchers go under
    PREFIX/lib/ibckpt/launch/. With the compiled front (native/front) the two entry points are copies of
    it: it answers what is not ours without Python and execs those launchers for the rest, and finds
    runc as PREFIX/lib/ibckpt/runc. Without it, they are the launchers (the wrapper a shell script)."""
    libdir = f"{prefix}/lib/ibckpt/python"
    launch = top / "lib" / "ibckpt" / "launch"
    launch.mkdir(parents=True, exist_ok=True)
    hook = launcher(python, libdir, "ibckpt_node.hook.main")
    _write(launch / "ibckpt-hook", hook, 0o755)
    _write(
        launch / "ibckpt-runc", launcher(python, libdir, "ibckpt_node.hook.runc", f"main({runc!r})"), 0o755
    )
    (top / "bin").mkdir(parents=True, exist_ok=True)
    if front is None:
        _write(
            top / "bin" / "ibckpt-runc", runc_launcher(f"{prefix}/lib/ibckpt/launch/ibckpt-runc", runc), 0o755
        )
        _write(top / "bin" / "ibckpt-hook", hook, 0o755)
        return
    _link(top / "lib" / "ibckpt" / "runc", runc)
    binary = front.read_bytes()
    for name in ("ibckpt-runc", "ibckpt-hook"):
        path = top / "bin" / name
        if not (path.is_file() and path.read_bytes() == binary):  # an agent's restart: left as it is
            _write(path, binary, 0o755)


class InstallError(Exception):
    """The node's files cannot be installed as they are; the message says why."""


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build_host_path(prefix: str, digest: str) -> str:
    """Where build `digest` of the shim lives on the node (the path containers mount)."""
    return f"{prefix}/lib/ibckpt/{oci.SHIM_BUILDS}/{digest}/{oci.SHIM_FILE}"


def keep_build(shim: Path, lib_dir: Path) -> str:
    """Keep this shim under LIB_DIR/builds/<its sha256>/ unless it is there; returns the digest.

    A build's file is never rewritten: containers bind-mount it, so a new file under them leaves their
    processes mapping a deleted one, which CRIU cannot restore ("Can't re-create deleted file"). A file
    whose bytes are not its name's is refused, not replaced: something else wrote there."""
    digest = file_digest(shim)
    dest = lib_dir / oci.SHIM_BUILDS / digest / oci.SHIM_FILE
    if dest.exists():
        if file_digest(dest) != digest:
            raise InstallError(
                f"{dest} holds other bytes than build {digest}: remove it and restart the agent"
            )
        return digest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(shim, tmp)
    tmp.chmod(0o644)
    tmp.replace(dest)
    return digest


def install_shim(shim: Path, lib_dir: Path) -> str:
    """Install the shim as its build (keep_build); returns its digest. A shim a release before kept
    builds installed as LIB_DIR/libibckpt.so is kept as a build too, and left where it is: its pods
    mount it, and their checkpoints recorded its digest."""
    legacy = lib_dir / oci.SHIM_FILE
    if legacy.is_file():
        keep_build(legacy, lib_dir)
    return keep_build(shim, lib_dir)


def installed_builds(lib_dir: Path) -> list[str]:
    """The digests of the shim builds the node holds."""
    builds = lib_dir / oci.SHIM_BUILDS
    try:
        names = sorted(p.name for p in builds.iterdir())
    except OSError:
        return []
    return [name for name in names if oci.is_build_digest(name) and (builds / name / oci.SHIM_FILE).is_file()]


def install_criu_plugins(source: Path, lib_dir: Path) -> bool:
    """CRIU's plugins for pre-dumps (ibckpt_uverbs.so) as LIB_DIR/criu/, where runc's CRIU on the node
    loads them (CRIU_LIBS_DIR); False when the image has none. A plugin is replaced whole: a CRIU that
    starts meanwhile loads the old file or the new one."""
    plugins = sorted(source.glob("*.so")) if source.is_dir() else []
    if not plugins:
        return False
    target = lib_dir / "criu"
    target.mkdir(parents=True, exist_ok=True)
    for plugin in plugins:
        tmp = target / f".{plugin.name}.ibckpt-tmp"
        shutil.copyfile(plugin, tmp)
        tmp.chmod(0o644)
        tmp.replace(target / plugin.name)
    return True


def install(
    root: Path,
    prefix: str,
    python: str,
    shim: Path | None,
    config: dict[str, object] | None,
    criu_plugins: Path | None = None,
    front: Path | None = None,
) -> str | None:
    """Install everything; returns the shim's build path on the node (None: no shim given), which
    node.json's `shim` then names."""
    top = root / prefix.lstrip("/")
    libdir = f"{prefix}/lib/ibckpt/python"
    pkg = root / libdir.lstrip("/") / "ibckpt_node"
    (pkg / "hook").mkdir(parents=True, exist_ok=True)
    _write(pkg / "__init__.py", '"""ibckpt_node: the node-side hook only (installed copy)."""\n', 0o644)
    for name in MODULES:
        _write(pkg / "hook" / name, (HERE / name).read_text(), 0o644)
    runc = str((config or {}).get("runc", "/usr/sbin/runc"))
    # the wrapper passes most calls through without reading node.json: it gets runc here
    install_entry_points(top, prefix, python, runc, front)
    installed = None
    if criu_plugins is not None:
        install_criu_plugins(criu_plugins, top / "lib" / "ibckpt")
    if shim is not None:
        (top / "lib" / "ibckpt").mkdir(parents=True, exist_ok=True)
        installed = build_host_path(prefix, install_shim(shim, top / "lib" / "ibckpt"))
    if config is not None:
        if installed is not None:
            config = {**config, "shim": installed}
        etc = root / "etc" / "ibckpt"
        etc.mkdir(parents=True, exist_ok=True)
        _write(etc / "node.json", json.dumps(config, indent=2) + "\n", 0o644)
    return installed


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m ibckpt_node.hook.install"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/", help="the node's / as this process sees it")
    parser.add_argument("--prefix", default="/usr/local")
    parser.add_argument("--python", default="/usr/bin/python3", help="the node's python3 (>= 3.9)")
    parser.add_argument("--shim", type=Path, help="libibckpt.so to keep as PREFIX/lib/ibckpt/builds/SHA256/")
    parser.add_argument("--config", help="JSON object to write as /etc/ibckpt/node.json")
    parser.add_argument(
        "--front", type=Path, help="ibckpt-front (native/front) to install as both entry points"
    )
    args = parser.parse_args(argv)
    config = json.loads(args.config) if args.config else None
    install(Path(args.root), args.prefix, args.python, args.shim, config, front=args.front)
    print(f"installed under {os.path.join(args.root, args.prefix.lstrip('/'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
