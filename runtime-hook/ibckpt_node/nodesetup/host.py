"""The node side of nodesetup: probes, file writes and containerd's restart (the thin driver).

The agent sees the node's files under `root` (the chart's hostPath mounts under /host) and runs the
node's binaries in the node's mount namespace (nsenter, as it runs runc). It shares the node's pid
namespace, so /proc here is the node's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ibckpt_node.container_runtime import in_node_mount_namespace
from ibckpt_node.nodesetup import containerd, prereqs

log = logging.getLogger(__name__)

RESTART_MODES = ("auto", "systemd", "signal", "none")
NODE_CONFIG = "/etc/ibckpt/node.json"  # hook/oci.py DEFAULT_CONFIG_FILE, written by hook/install.py
CONTAINERD_TASKS = "/run/containerd/io.containerd.runtime.v2.task"


@dataclass(frozen=True)
class NodeSetup:
    root: Path  # the node's / as the agent sees it
    prefix: str  # PREFIX/bin/ibckpt-runc, PREFIX/lib/ibckpt
    next_runtime: str  # what the wrapper execs: runc, or nvidia-container-runtime on GPU nodes
    node_python: str
    config: str = "/etc/containerd/config.toml"
    dropin: str = "/etc/containerd/conf.d/ibckpt.toml"
    restart: str = "auto"
    manage: bool = True
    handler_name: str = "ibckpt"  # the RuntimeClass's handler
    # The whole node as pid 1 sees it (the agent shares the node's pid namespace): for what lies outside
    # the chart's mounts, such as the next runtime in /usr/sbin or /usr/bin.
    node_fs: Path = Path("/proc/1/root")

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def on_node(self, path: str) -> Path:
        return self.node_fs / path.lstrip("/")

    @property
    def handler(self) -> containerd.Handler:
        return containerd.Handler(name=self.handler_name, binary=f"{self.prefix}/bin/ibckpt-runc")


# A probe's bound (`criu --version`, `python3 -c`). A slow node is not a node that lacks something: on an
# emulated node busy with its first pods, python3's start alone took over 30 s, and the agent stayed
# not Ready for minutes, its Event saying python3 could not run.
PROBE_TIMEOUT_S = 120.0


def run_on_node(argv: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int | None, str]:
    """(status, output) of a command in the node's mount namespace; status None: it could not start,
    or gave no answer within `timeout_s`."""
    try:
        proc = subprocess.run(
            [*in_node_mount_namespace(), *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return None, str(exc)
    if proc.returncode in (126, 127):  # nsenter's "cannot execute" / "not found"
        return None, proc.stderr
    return proc.returncode, proc.stdout + proc.stderr


def check(setup: NodeSetup) -> list[prereqs.Finding]:
    """Every prerequisite, found on the node."""
    found = []
    runtime = setup.on_node(setup.next_runtime)
    found.append(
        prereqs.executable("next runtime", setup.next_runtime, runtime.exists(), os.access(runtime, os.X_OK))
    )
    for name, path in (
        ("runtime wrapper", f"{setup.prefix}/bin/ibckpt-runc"),
        ("OCI hook", f"{setup.prefix}/bin/ibckpt-hook"),
    ):
        host = setup.host(path)
        found.append(prereqs.executable(name, path, host.exists(), os.access(host, os.X_OK)))
    shim = installed_shim(setup)
    found.append(prereqs.Finding("shim", setup.host(shim).is_file(), shim))
    found.append(prereqs.criu(*run_on_node(["criu", "--version"])))
    code = "import sys; print(*sys.version_info[:2])"
    found.append(prereqs.python(setup.node_python, *run_on_node([setup.node_python, "-c", code])))
    found += prereqs.kernel({path: Path(path).exists() for path in prereqs.KERNEL_PATHS})
    if setup.manage and not setup.host(setup.config).is_file():
        found.append(
            prereqs.Finding(
                "containerd config", False, f"no {setup.config} (write `containerd config default`)"
            )
        )
    return found


def installed_shim(setup: NodeSetup) -> str:
    """The shim new containers mount: the build node.json names (the agent's install writes both), or
    the file of a release before builds were kept."""
    try:
        shim = json.loads(setup.host(NODE_CONFIG).read_text()).get("shim")
    except (OSError, ValueError, AttributeError):
        shim = None
    return shim if isinstance(shim, str) and shim else f"{setup.prefix}/lib/ibckpt/libibckpt.so"


def _write(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".ibckpt-tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)  # containerd reads the old file or the new one, never half of one


def install_handler(setup: NodeSetup) -> containerd.Edit:
    main = setup.host(setup.config)
    edit = containerd.install(main.read_text(), setup.handler, setup.config, setup.dropin)
    if edit.dropin is not None:
        dropin = setup.host(setup.dropin)
        if not dropin.exists() or dropin.read_text() != edit.dropin:
            _write(dropin, edit.dropin)
            edit = containerd.Edit(edit.main, edit.dropin, True, edit.note)
    if edit.main != main.read_text():
        _write(main, edit.main)
    return edit


def remove_handler(setup: NodeSetup) -> containerd.Edit:
    main = setup.host(setup.config)
    if not main.is_file():
        return containerd.Edit("", None, False, f"no {setup.config}")
    edit = containerd.remove(main.read_text(), setup.dropin)
    if edit.changed:
        _write(main, edit.main)
    dropin = setup.host(setup.dropin)
    if edit.dropin == "" and dropin.exists():
        dropin.unlink()
        edit = containerd.Edit(edit.main, "", True, edit.note)
    return edit


def containerd_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "containerd":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _started_at(pid: int) -> float:
    """A process's start, in seconds since the epoch (its stat's starttime after boot)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])
    with open("/proc/stat") as stat:
        boot = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def containerd_loaded(setup: NodeSetup) -> bool:
    """Whether the running containerd started after the handler's files last changed (containerd
    reads its config only when it starts)."""
    files = [setup.host(setup.config), setup.host(setup.dropin)]
    changed = max((f.stat().st_mtime for f in files if f.exists()), default=0.0)
    pids = containerd_pids()
    try:
        return bool(pids) and all(_started_at(pid) >= changed - 1.0 for pid in pids)
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def containerd_answers(setup: NodeSetup) -> bool:
    """Whether containerd accepts on its socket: its process starts some seconds before it serves, and
    a node called ready meanwhile had its first kubectl exec refused (the socket was not there yet)."""
    try:
        where = containerd.socket_path(setup.host(setup.config).read_text())
    except OSError:
        where = containerd.DEFAULT_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(setup.on_node(where)))
        except OSError:
            return False
    return True


def restart_mode(setup: NodeSetup) -> str:
    if setup.restart != "auto":
        return setup.restart
    status, _ = run_on_node(["systemctl", "is-active", "--quiet", "containerd"])
    return "systemd" if status == 0 else "none"


def restart_containerd(setup: NodeSetup, timeout_s: float = 90.0) -> str:
    """Restart containerd so that it reads the handler; running containers keep running (each is
    held by its own containerd-shim process, which containerd reconnects to when it is back).
    The reason it could not, or ""."""
    mode = restart_mode(setup)
    if mode == "none":
        return (
            "containerd must be restarted to load the ibckpt handler and nothing here restarts it: restart "
            "it on the node, or set agent.runtimeRestart (systemd, or signal when a supervisor restarts it)"
        )
    before = containerd_pids()
    if mode == "systemd":
        status, output = run_on_node(["systemctl", "restart", "containerd"], timeout_s)
        if status != 0:
            return f"`systemctl restart containerd` failed ({status}): {output.strip()[:300]}"
    else:
        for pid in before:
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = containerd_pids()
        if now and not set(now) & set(before) and containerd_loaded(setup) and containerd_answers(setup):
            log.info("containerd restarted (pid %s) with the ibckpt handler", ",".join(map(str, now)))
            return ""
        time.sleep(1.0)
    return f"containerd did not come back within {timeout_s:g}s of its restart ({mode})"


def wrapper_in_use(setup: NodeSetup) -> list[str]:
    """Containers whose shim was started with our wrapper: its later calls (kill, delete) exec it, so
    it must stay while they run. From each task's options.json under containerd's state."""
    users = []
    for options in setup.host(CONTAINERD_TASKS).glob("*/*/options.json"):
        try:
            if setup.handler.binary in options.read_text():
                users.append(options.parent.name)
        except OSError:
            continue
    return users


def remove_files(setup: NodeSetup) -> list[str]:
    """The installer's files (hook, wrapper, shim, node.json); kept while a container uses the
    wrapper. What was removed, or why not."""
    users = wrapper_in_use(setup)
    if users:
        return [f"kept the wrapper, hook and shim: containers {', '.join(users[:5])} still run through it"]
    done = []
    for path in (
        f"{setup.prefix}/bin/ibckpt-runc",
        f"{setup.prefix}/bin/ibckpt-hook",
        NODE_CONFIG,
    ):
        host = setup.host(path)
        if host.exists():
            host.unlink()
            done.append(path)
    # the chart mounts PREFIX/lib/ibckpt itself: its contents (every shim build too) go, the mount point stays
    lib = setup.host(f"{setup.prefix}/lib/ibckpt")
    for child in lib.glob("*") if lib.is_dir() else []:
        shutil.rmtree(child) if child.is_dir() else child.unlink()
        done.append(f"{setup.prefix}/lib/ibckpt/{child.name}")
    return done
