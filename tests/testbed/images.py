"""Container images for the testbed's nodes, built with no registry and no Docker engine.

Nothing can be pulled here, so every image starts from a Debian bookworm root made by
debootstrap and named the way Dockerfiles ask for it (`debian:bookworm-slim`). buildah
(vfs storage, chroot isolation) then builds:

- the pause image, from the Kubernetes tree's own pause.c (kept by build-kube.sh);
- `rdma-apps`, test programs as outsiders ship them: Debian's perftest, ibverbs-utils,
  rdmacm-utils, Open MPI and pyverbs, plus the project's verbs test programs;
- the product image, from the repository's own Dockerfile, as a user would build it;
- its next release (`ibckpt:next`): the same image with another shim file, for the upgrade story.

Each image is written as a docker-archive tar that `ctr images import` takes, cached in
$IBCKPT_CACHE/images under a hash of its inputs: a second run costs nothing.

The build steps run apt and pip inside the image. The machine's own apt and pip settings and
CA bundle are bind-mounted for those steps only (buildah `-v`), so they never land in an image.

CLI: python -m testbed.images [build] [--only NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.guest import REPO, cache_dir
from testbed.reaper import die_with_parent

BASE_NAME = "docker.io/library/debian:bookworm-slim"
PAUSE_IMAGE = "ibckpt.local/pause:3.2"
APPS_IMAGE = "ibckpt.local/rdma-apps:test"
PRODUCT_IMAGE = "ibckpt.local/ibckpt:dev"
NEXT_IMAGE = "ibckpt.local/ibckpt:next"  # the upgrade story's later release: another shim file
IMAGES_DIR = REPO / "tests" / "images"

# Settings of this machine that apt inside a build step needs (read-only mounts).
_APT_MOUNTS = ("/etc/apt/apt.conf.d", "/etc/apt/sources.list.d")
# pip inside a build step trusts the machine's CA bundle, mounted beside the image's own
# (which the image's ca-certificates package must be free to rewrite).
_HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
_BUILD_CA = "/etc/ibckpt-build/ca.crt"


@dataclass(frozen=True)
class Image:
    name: str  # the reference pods use, with imagePullPolicy: Never
    tar: Path  # docker-archive for `ctr images import`


def _store_args() -> list[str]:
    root = cache_dir() / "buildah"
    return [
        "--storage-driver",
        "vfs",
        "--root",
        str(root / "storage"),
        "--runroot",
        str(root / "run"),
    ]


def _buildah(*args: str, log: Path | None = None, cwd: Path | None = None) -> str:
    cmd = ["buildah", *_store_args(), *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(
            f"buildah {args[0]} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc.stdout.strip()


def _has_image(name: str) -> bool:
    proc = subprocess.run(["buildah", *_store_args(), "images", "-q", name], capture_output=True, text=True)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def _mirror() -> str:
    """The Debian mirror this machine's apt already uses (never spelled out in the repo)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    for line in Path("/etc/apt/sources.list").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == "deb" and parts[2].startswith("bookworm"):
            return parts[1]
    raise RuntimeError("no bookworm apt source on this machine to debootstrap from")


def _hash_files(paths: Iterable[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for path in sorted(paths):
        h.update(str(path.relative_to(REPO)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _tracked(*tops: str) -> list[Path]:
    """Files git tracks under tops, plus untracked ones it does not ignore (a dev's new files)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", *tops],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [REPO / p for p in out.splitlines() if (REPO / p).is_file()]


def base(log: Path) -> None:
    """`debian:bookworm-slim` from debootstrap (minbase), once per buildah store."""
    if _has_image(BASE_NAME):
        return
    with tempfile.TemporaryDirectory(prefix="ibckpt-base-") as tmp:
        root = Path(tmp) / "root"
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(root), _mirror()],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        # Like the official slim image: no apt caches, and docs are not installed.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "-cf", str(tar), "."], check=True)
        ctr = _buildah("from", "scratch", log=log)
        try:
            _buildah("add", ctr, str(tar), "/", log=log)
            _buildah(
                "config",
                "--cmd",
                "bash",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                ctr,
                log=log,
            )
            _buildah("commit", "--rm", ctr, BASE_NAME, log=log)
        except BaseException:
            subprocess.run(["buildah", *_store_args(), "rm", ctr], capture_output=True)
            raise


def _export(name: str, key: str, log: Path) -> Image:
    out = cache_dir() / "images"
    out.mkdir(parents=True, exist_ok=True)
    stem = name.rsplit("/", 1)[-1].replace(":", "_")
    tar = out / f"{stem}-{key}.tar"
    if not tar.exists():
        tmp = tar.with_suffix(".part")
        tmp.unlink(missing_ok=True)
        _buildah("push", name, f"docker-archive:{tmp}:{name}", log=log)
        tmp.rename(tar)
        for old in out.glob(f"{stem}-*.tar"):
            if old != tar:
                old.unlink()
    return Image(name, tar)


def _cached(name: str, key: str) -> Image | None:
    stem = name.rsplit("/", 1)[-1].replace(":", "_")
    tar = cache_dir() / "images" / f"{stem}-{key}.tar"
    return Image(name, tar) if tar.exists() else None


def pause(log: Path) -> Image:
    src = cache_dir() / "kube" / "pause.c"
    if not src.exists():
        raise RuntimeError(f"{src} missing: run tests/testbed/build-kube.sh (make kube)")
    key = _hash_files([], src.read_text())
    if (hit := _cached(PAUSE_IMAGE, key)) is not None:
        return hit
    with tempfile.TemporaryDirectory(prefix="ibckpt-pause-") as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(
            ["gcc", "-Os", "-static", "-DVERSION=v3.2-ibckpt", "-o", str(binary), str(src)],
            check=True,
            capture_output=True,
        )
        ctr = _buildah("from", "scratch", log=log)
        _buildah("copy", ctr, str(binary), "/pause", log=log)
        _buildah("config", "--entrypoint", '["/pause"]', ctr, log=log)
        _buildah("commit", "--rm", ctr, PAUSE_IMAGE, log=log)
    return _export(PAUSE_IMAGE, key, log)


def _bud(name: str, containerfile: Path, context: Path, key: str, log: Path) -> Image:
    if (hit := _cached(name, key)) is not None:
        return hit
    base(log)
    mounts: list[str] = []
    for path in _APT_MOUNTS:
        if Path(path).exists():
            mounts += ["-v", f"{path}:{path}:ro"]
    settings = Path(tempfile.mkdtemp(prefix="ibckpt-build-settings-"))
    pip_conf = settings / "pip.conf"
    pip_conf.write_text(_pip_conf())
    mounts += ["-v", f"{pip_conf}:/etc/pip.conf:ro"]
    if _HOST_CA.exists():
        mounts += ["-v", f"{_HOST_CA}:{_BUILD_CA}:ro"]
    try:
        _build(name, containerfile, context, mounts, log)
    finally:
        shutil.rmtree(settings, ignore_errors=True)
    return _export(name, key, log)


def _pip_conf() -> str:
    """The machine's pip settings, with its CA bundle at the path it is mounted at in a build."""
    host = Path("/etc/pip.conf")
    lines = host.read_text().splitlines() if host.exists() else ["[global]"]
    kept = [ln for ln in lines if not ln.replace(" ", "").startswith("cert=")]
    if _HOST_CA.exists():
        kept.insert(kept.index("[global]") + 1 if "[global]" in kept else 0, f"cert = {_BUILD_CA}")
    return "\n".join(kept) + "\n"


def _build(name: str, containerfile: Path, context: Path, mounts: list[str], log: Path) -> None:
    _buildah(
        "bud",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--pull-never",
        "--layers=false",
        *mounts,
        "-f",
        str(containerfile),
        "-t",
        name,
        str(context),
        log=log,
    )


def apps(log: Path) -> Image:
    containerfile = IMAGES_DIR / "rdma-apps" / "Containerfile"
    inputs = _tracked(
        "native/tests", "native/include", "native/Makefile", "tests/mpi/jacobi.c", "tests/mpi/rexec.py"
    )
    key = _hash_files([containerfile, *inputs])
    return _bud(APPS_IMAGE, containerfile, REPO, key, log)


def product(log: Path) -> Image:
    dockerfile = REPO / "Dockerfile"
    inputs = _tracked(
        "Dockerfile", "pyproject.toml", "README.md", "ibckpt", "operator", "runtime-hook", "native"
    )
    key = _hash_files([p for p in inputs if "__pycache__" not in p.parts])
    return _bud(PRODUCT_IMAGE, dockerfile, REPO, key, log)


# The next release's shim: the same code with a trailer, so another file (another size and sha256) at
# the same path, as a changed shim is to CRIU and to the node's kept builds. The loader maps only the
# segments the ELF headers name, so the trailer is never read.
NEXT_SHIM = "usr/lib/ibckpt/libibckpt.so"  # the Dockerfile's
NEXT_SHIM_TRAILER = b"\n# ibckpt testbed: the next release's shim\n"


def next_release(log: Path, built: Image | None = None) -> Image:
    """The product image (`built`, or built now) as a later release would ship it, for
    `helm upgrade --set image.tag=next`."""
    built = built or product(log)
    key = _hash_files([], f"{built.tar.name}\0{NEXT_SHIM}\0{NEXT_SHIM_TRAILER!r}")
    if (hit := _cached(NEXT_IMAGE, key)) is not None:
        return hit
    ctr = _buildah("from", "-q", f"docker-archive:{built.tar}", log=log).splitlines()[-1]
    try:
        root = Path(_buildah("mount", ctr, log=log).splitlines()[-1])
        with open(root / NEXT_SHIM, "ab") as shim:
            shim.write(NEXT_SHIM_TRAILER)
        _buildah("umount", ctr, log=log)
        _buildah("commit", ctr, NEXT_IMAGE, log=log)
    finally:
        _buildah("rm", ctr, log=log)
    return _export(NEXT_IMAGE, key, log)


BUILDERS = {"pause": pause, "rdma-apps": apps, "ibckpt": product, "ibckpt-next": next_release}

# How long an unused node store (another checkout's) is kept before a new one replaces it.
STORE_KEEP_S = 6 * 3600


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One build at a time per cache: the test session builds in the background (tests/conftest.py)
    while a test may ask for the same images; the later one waits, then finds them cached."""
    lock = cache_dir() / "images" / "build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def node_store(built: dict[str, Image], log: Path | None = None) -> Path:
    """A containerd root holding every image, unpacked once on the host and shared by the nodes.

    Importing an image inside a TCG guest took minutes (every file of every layer written
    through an emulated CPU); here it takes seconds. A node mounts the unpacked layers as the
    lower dirs of its containers' overlays and keeps only its own changes in memory.
    """
    with _exclusive():
        return _node_store(built, log)


def _node_store(built: dict[str, Image], log: Path | None) -> Path:
    log = log or cache_dir() / "images" / "build.log"
    key = hashlib.sha256(" ".join(sorted(str(i.tar) for i in built.values())).encode()).hexdigest()[:16]
    stores = cache_dir() / "node-store"
    root = stores / key
    if (root / "ready").exists():
        (root / "ready").touch()  # in use: kept by the clean-up below
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = Path(tempfile.mkdtemp(prefix="ibckpt-ctrd-"))
    sock = state / "containerd.sock"
    (state / "config.toml").write_text(
        f'version = 2\nroot = "{root}"\nstate = "{state}"\n[grpc]\n  address = "{sock}"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n  snapshotter = "overlayfs"\n'
    )
    with open(log, "a") as out:
        daemon = subprocess.Popen(
            ["containerd", "-c", str(state / "config.toml")], stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd for the node store did not start (see {log})")
            time.sleep(0.1)
        for image in built.values():
            proc = subprocess.run(
                ["ctr", "-a", str(sock), "-n", "k8s.io", "images", "import", "--snapshotter", "overlayfs",
                 str(image.tar)],
                capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"ctr import {image.tar} failed: {proc.stderr[-2000:]}")
    finally:
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state, ignore_errors=True)
    (root / "ready").write_text("")
    # Another checkout's cluster may still run on an older store: drop only long-unused ones.
    for old in stores.iterdir():
        ready = old / "ready"
        if old != root and (not ready.exists() or time.time() - ready.stat().st_mtime > STORE_KEEP_S):
            shutil.rmtree(old, ignore_errors=True)
    return root


def build(only: Sequence[str] = (), log: Path | None = None) -> dict[str, Image]:
    """Build (or take from the cache) every image; returns them by short name."""
    log = log or cache_dir() / "images" / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out: dict[str, Image] = {}
    with _exclusive():
        for short, builder in BUILDERS.items():
            if only and short not in only:
                continue
            started = time.monotonic()
            # the next release derives from the product image this build made, not from one built again
            out[short] = next_release(log, out.get("ibckpt")) if builder is next_release else builder(log)
            print(f"images: {short} {out[short].name} ({time.monotonic() - started:.1f}s) {out[short].tar}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.images", description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", default="build", choices=["build"])
    parser.add_argument("--only", action="append", default=[], choices=sorted(BUILDERS))
    args = parser.parse_args(argv)
    if shutil.which("buildah") is None or shutil.which("debootstrap") is None:
        print("images: buildah and debootstrap are needed (make system)", file=sys.stderr)
        return 2
    os.umask(0o022)
    built = build(args.only)
    if not args.only:
        print(f"images: node store {node_store(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
