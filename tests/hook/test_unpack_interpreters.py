"""The wrapper's unpack runs nothing from the container's root, under every Python on this machine.

The hook runs under the node's own Python (`agent.nodePython`, 3.9 or newer), and what an interpreter
imports lazily changes between versions: Python 3.13's tarfile imports `warnings` during an extract,
which, chrooted into the container's root, ran the container's `warnings.py` as root on the node
(review N8). So the root here holds a planted `warnings.py`, `encodings/`, `sitecustomize.py` at each
interpreter's import path, an NSS module and the `nsswitch.conf` that names it, each of which writes a
marker when it runs; a first run proves they would run if anything imported or looked up from the
root, then the real unpack must leave no marker.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hook.tars import member, write_tar

from ibckpt_node.hook import oci, restore

HERE = Path(__file__).resolve().parent
HOOK_LIB = str(HERE.parents[1] / "runtime-hook")
CHILD = str(HERE / "planted_root_child.py")
MULTIARCH_LIBS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib")
BAITS = ("warnings", "encodings", "sitecustomize", "nss")


def pythons() -> list[str]:
    """Every Python 3.9+ here: this one, the system's, and any pyenv keeps (one per real binary)."""
    found = [sys.executable, *glob.glob("/usr/bin/python3*"), *glob.glob("/usr/local/bin/python3*")]
    found += glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))
    chosen: dict[str, str] = {}
    for path in found:
        name = os.path.basename(path)
        versioned = name == "python3" or name.replace("python3.", "", 1).isdigit()
        if not versioned or not os.access(path, os.X_OK):
            continue
        real = os.path.realpath(path)
        if real in chosen.values():
            continue
        probe = [path, "-I", "-c", "import sys; print(int(sys.version_info >= (3, 9)))"]
        if subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout.strip() == "1":
            chosen[path] = real
    return sorted(chosen)


def child(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-I", CHILD, *args], capture_output=True, text=True, timeout=120)


def run(python: str, *args: str) -> str:
    done = child(python, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


@functools.lru_cache(maxsize=1)
def nss_module(build_dir: str, marker: str) -> Path:
    """An NSS module whose constructor writes `marker` (glibc loads it when nsswitch.conf names it)."""
    source = Path(build_dir, "bait.c")
    source.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void bait(void)\n"
        f'{{ int fd = open("{marker}", O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd); }}\n'
    )
    out = Path(build_dir, "libnss_ibckptbait.so.2")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(source)], check=True, timeout=120)
    return out


def plant(top: Path, import_path: list[str], markers: Path, nss: Path) -> None:
    """Every bait into `top` (a container's root, or its /dev/shm), where a chrooted process would use it."""
    for bait in BAITS:
        code = f"import os\nos.close(os.open({str(markers / bait)!r}, os.O_WRONLY | os.O_CREAT, 0o644))\n"
        for where in import_path:
            inside = top / where.lstrip("/")
            if bait == "encodings":
                (inside / "encodings").mkdir(parents=True, exist_ok=True)
                (inside / "encodings" / "__init__.py").write_text(code)
            elif bait != "nss":
                inside.mkdir(parents=True, exist_ok=True)
                (inside / f"{bait}.py").write_text(code)
    for lib in MULTIARCH_LIBS:
        (top / lib).mkdir(parents=True, exist_ok=True)
        (top / lib / nss.name).write_bytes(nss.read_bytes())
    (top / "etc").mkdir(exist_ok=True)
    (top / "etc" / "nsswitch.conf").write_text("passwd: ibckptbait\ngroup: ibckptbait\n")
    (top / markers.relative_to("/")).mkdir(parents=True)  # where a chrooted bait writes


@pytest.mark.parametrize("python", pythons())
def test_the_unpack_runs_nothing_from_the_root_under_every_python(tmp_path: Path, python: str) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    build = tmp_path / "build"
    build.mkdir()
    nss = nss_module.__wrapped__(str(build), str(markers / "nss"))
    import_path = json.loads(run(python, "paths"))
    rootfs, shm, images = tmp_path / "rootfs", tmp_path / "shm", tmp_path / "images"
    for top in (rootfs, shm):
        plant(top, import_path, markers, nss)
    images.mkdir()

    # the baits are live: chrooted, this interpreter would run every one of them
    run(python, "bait", str(rootfs))
    assert sorted(p.name for p in (rootfs / markers.relative_to("/")).iterdir()) == sorted(BAITS)
    for marker in (rootfs / markers.relative_to("/")).iterdir():
        marker.unlink()

    # owners by name that exist nowhere (a lookup would load the NSS bait), a setuid file, a link
    named: dict[str, Any] = {"uname": "ibckpt-bait", "gname": "ibckpt-bait", "uid": 4321, "gid": 4321}
    write_tar(
        images / restore.ROOTFS_DIFF,
        [
            member("./srv", tarfile.DIRTYPE, mode=0o755, **named),
            member("./srv/state", data=b"before the cut", mode=0o4755, **named),
            member("./srv/latest", tarfile.SYMTYPE, linkname="state", **named),
            member("./etc/debian_version", tarfile.CHRTYPE, devmajor=0, devminor=0),
        ],
    )
    write_tar(images / oci.SHM_ARCHIVE, [member("./seg", data=b"shm", mode=0o600, **named)])
    done = child(python, "unpack", HOOK_LIB, str(images), str(rootfs), str(shm))

    ran = [p for top in (Path("/"), rootfs, shm) for p in (top / markers.relative_to("/")).iterdir()]
    assert ran == [], f"{python} ran files of the container's root: {ran} ({done.stderr.strip()})"
    assert done.returncode == 0 and done.stdout.strip() == "applied", done.stderr
    assert (rootfs / "srv" / "state").read_bytes() == b"before the cut"
    assert (rootfs / "srv" / "state").stat().st_mode & 0o7777 == 0o755
    assert (rootfs / "srv" / "state").stat().st_uid == 4321
    assert os.readlink(rootfs / "srv" / "latest") == "state"
    assert (shm / "seg").read_bytes() == b"shm"
