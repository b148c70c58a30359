"""Boot Soft-RoCE qemu guests (TCG) that share the host's filesystem and run one command.

One guest: rxe0 on a dummy netdev (10.77.0.1). Two guests ("node A" = 1, "node B" = 2):
rxe0 on a virtio-net NIC each, joined by qemu's stream netdev over one unix socket (or, with
IBCKPT_GUEST_LINK=dgram, its dgram netdev over a pair), so no IP packet ever touches the host's
network. Host services on 127.0.0.1 (apiserver,
S3, coordinator) are reachable from a guest at GUEST_HOST_ADDR:<same port>, through
qemu's user-mode network in restrict mode with one forward per port.

CLI: python -m testbed.guest run [--timeout S] [--two] -- 'shell command'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.reaper import die_with_parent

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GUEST_HOST_ADDR = "10.0.2.100"
# The guest's own address on qemu's user-mode NIC (guest-init2.sh).
GUEST_USER_ADDR = "10.0.2.15"
# Modules the initramfs needs before the host's tree (and its /lib/modules) is mounted.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_net")


def cache_dir() -> Path:
    return Path(os.environ.get("IBCKPT_CACHE", Path.home() / ".cache" / "ibckpt"))


@dataclass(frozen=True)
class Kernel:
    version: str
    vmlinuz: Path
    modules_root: Path  # contains lib/modules/<version>

    @property
    def modules_dir(self) -> Path:
        return self.modules_root / "lib" / "modules" / self.version


def kernel() -> Kernel:
    root = cache_dir() / "kernel"
    kver_file = root / "kver"
    if not kver_file.exists():
        raise RuntimeError(f"no guest kernel in {root}: run tests/testbed/fetch-kernel.sh (make kernel)")
    return Kernel(kver_file.read_text().strip(), root / "vmlinuz", root)


def _module_insmod_order(k: Kernel) -> list[Path]:
    order: list[Path] = []
    for name in INITRAMFS_MODULES:
        out = subprocess.run(
            ["modprobe", "-d", str(k.modules_root), "-S", k.version, "--show-depends", name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and Path(parts[1]) not in order:
                order.append(Path(parts[1]))
    return order


def initramfs() -> Path:
    """The busybox initramfs, built once per kernel and init script and cached."""
    k = kernel()
    stage1 = (HERE / "guest-init1.sh").read_bytes()
    key = hashlib.sha256(stage1 + k.version.encode()).hexdigest()[:16]
    path = cache_dir() / f"initramfs-{key}.cpio.gz"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory(prefix="ibckpt-initramfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "mods"):
            (root / d).mkdir()
        shutil.copy2("/bin/busybox", root / "bin" / "busybox")
        init = root / "init"
        init.write_bytes(stage1)
        init.chmod(0o755)
        order = []
        for ko in _module_insmod_order(k):
            dest = root / "mods" / ko.name
            shutil.copy2(ko, dest)
            order.append(f"/mods/{ko.name}")
        (root / "modules.order").write_text("\n".join(order) + "\n")
        files = subprocess.run(["find", ".", "-print0"], cwd=root, check=True, capture_output=True).stdout
        cpio = subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet"],
            cwd=root,
            input=files,
            check=True,
            capture_output=True,
        ).stdout
        tmp_out = path.with_suffix(".tmp")
        with gzip.open(tmp_out, "wb", compresslevel=6) as f:
            f.write(cpio)
        tmp_out.rename(path)
    return path


@dataclass
class GuestSpec:
    """One guest to boot: what to run and what it may reach."""

    command: str
    node: int = 1
    link: bool = False  # True in two-guest mode
    cpus: int = 2
    memory_mb: int = 1536
    writable: Sequence[Path] = ()
    forward_ports: Sequence[int] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO
    # (host loopback port, guest port) pairs: qemu forwards 127.0.0.1:host to the guest's user NIC.
    host_forwards: Sequence[tuple[int, int]] = ()
    # Soft-RoCE devices: 2 adds rxe1 (10.78.0.<node>), for several HCAs per process: on a second link
    # between the cluster's nodes (GuestPair), else on a dummy netdev of its own
    # (tests/native/test_devices_guest.py); the one `guest` run of a session keeps 1.
    devices: int = 1


@dataclass
class GuestResult:
    node: int
    returncode: int
    output: str
    seconds: float
    # Set when the guest was killed because its kernel locked up (LOCKUP_KILL_SECONDS).
    lockup: str | None = None


def _qemu_args(
    spec: GuestSpec, job: Path, link_netdev: str | None, link2_netdev: str | None = None
) -> list[str]:
    k = kernel()
    writable = [job, REPO, *spec.writable]
    rw_args: list[str] = []
    rw_cmdline = []
    for i, path in enumerate(dict.fromkeys(Path(p).resolve() for p in writable)):
        tag = f"rw{i}"
        rw_args += [
            "-fsdev",
            f"local,id={tag},path={path},security_model=none",
            "-device",
            f"virtio-9p-pci,fsdev={tag},mount_tag={tag}",
        ]
        rw_cmdline.append(f"{tag}:{path}")
    cmdline = " ".join(
        [
            "console=ttyS0",
            "quiet",
            "loglevel=3",
            "panic=-1",
            "oops=panic",
            f"ibckpt.init={HERE / 'guest-init2.sh'}",
            f"ibckpt.modules={k.modules_dir}",
            f"ibckpt.job={job}",
            f"ibckpt.rw={','.join(rw_cmdline)}",
            f"ibckpt.node={spec.node}",
            f"ibckpt.link={int(spec.link)}",
            f"ibckpt.devices={spec.devices}",
            # A sent frame's skb is freed at once, not when a later TX interrupt reclaims it:
            # rxe holds its QP until then, and destroying the QP waited (D state, in
            # __rxe_cleanup) for a reclaim that, on the emulated NIC, sometimes never came.
            "virtio_net.napi_tx=0",
        ]
    )
    # restrict=on: the guest reaches nothing but the forwarded loopback ports.
    user_net = "user,id=hostnet,restrict=on"
    for port in spec.forward_ports:
        user_net += f",guestfwd=tcp:{GUEST_HOST_ADDR}:{port}-cmd:socat STDIO TCP:127.0.0.1:{port}"
    for host_port, guest_port in spec.host_forwards:
        user_net += f",hostfwd=tcp:127.0.0.1:{host_port}-{GUEST_USER_ADDR}:{guest_port}"
    args = [
        "qemu-system-x86_64",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max",
        "-smp",
        str(spec.cpus),
        "-m",
        str(spec.memory_mb),
        "-display",
        "none",
        "-monitor",
        "none",
        "-serial",
        "stdio",
        "-no-reboot",
        "-nodefaults",
        "-kernel",
        str(k.vmlinuz),
        "-initrd",
        str(initramfs()),
        "-append",
        cmdline,
        "-fsdev",
        "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device",
        "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        *rw_args,
        "-netdev",
        user_net,
        "-device",
        "virtio-net-pci,netdev=hostnet,mac=52:54:00:12:34:56",
    ]
    if link_netdev is not None:
        args += [
            "-netdev",
            f"{link_netdev},id=link",
            "-device",
            f"virtio-net-pci,id={LINK_NIC_ID},netdev=link,mac=52:54:00:77:00:0{spec.node}",
        ]
        # A monitor to read the link NIC's virtqueues when its transmit queue stalls.
        args[args.index("-monitor") + 1] = f"unix:{job / 'monitor.sock'},server=on,wait=off"
    if link2_netdev is not None:  # the second HCA's own link (rxe1), told apart by its MAC
        args += [
            "-netdev",
            f"{link2_netdev},id=link2",
            "-device",
            f"virtio-net-pci,netdev=link2,mac=52:54:00:78:00:0{spec.node}",
        ]
    return args


def _prepare_job(spec: GuestSpec, root: Path) -> Path:
    job = root / f"node{spec.node}"
    job.mkdir(parents=True)
    (job / "cmd.sh").write_text(spec.command + "\n")
    (job / "cwd").write_text(str(spec.cwd))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **spec.env}
    (job / "env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()))
    return job


class _Guest:
    def __init__(
        self, spec: GuestSpec, root: Path, link: str | None, echo: bool, link2: str | None = None
    ) -> None:
        self.spec = spec
        self.job = _prepare_job(spec, root)
        self.echo = echo
        self.buffer = io.StringIO()
        self.stall_line: str | None = None
        self.lockup_line: str | None = None
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            _qemu_args(spec, self.job, link, link2),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        prefix = f"[node-{self.spec.node}] " if self.spec.link else ""
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").replace("\r", "")
            self.buffer.write(line)
            if self.spec.link and LINK_STALL_SIGNATURE in line and self.stall_line is None:
                self.stall_line = line.strip()
            stuck = LOCKUP_SIGNATURE.search(line)
            if stuck and int(stuck.group(1)) >= LOCKUP_KILL_SECONDS:
                self.lockup_line = line.strip()
            if self.echo:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()

    def wait(self, deadline: float) -> GuestResult:
        while self.proc.poll() is None and self.lockup_line is None and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if self.proc.poll() is None:
            lockup = self.lockup_line
            self.kill()
            self.reader.join(5)
            why = f"its kernel locked up ({lockup})" if lockup else "timed out"
            out = self.buffer.getvalue() + f"\nibckpt-guest: {why}, killed node-{self.spec.node}\n"
            return GuestResult(self.spec.node, 124, out, time.monotonic() - self.started, lockup)
        self.reader.join(5)
        rc_file = self.job / "rc"
        rc = int(rc_file.read_text()) if rc_file.exists() else 125
        return GuestResult(self.spec.node, rc, self.buffer.getvalue(), time.monotonic() - self.started)

    def link_queue_status(self) -> str:
        """The link NIC's virtqueue indices (rx 0, tx 1) from qemu's monitor, for the stall report."""
        out = []
        for queue in (0, 1):
            cmd = f"info virtio-queue-status /machine/peripheral/{LINK_NIC_ID}/virtio-backend {queue}\n"
            out.append(_monitor_command(self.job / "monitor.sock", cmd))
        return "\n".join(out)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def _job_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ibckpt-guest-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(spec: GuestSpec, timeout: float = 600.0, echo: bool = False) -> GuestResult:
    """Boot one guest, run spec.command, return its exit code and console output."""
    with _job_root() as root:
        guest = _Guest(spec, root, None, echo)
        return guest.wait(time.monotonic() + timeout)


# The link's unix datagram sockets queue at most net.unix.max_dgram_qlen datagrams at the receiver
# (10 by default); past that the sending qemu busy-retries until the receiver reads. Raised so a
# busy TCG peer does not throttle the other guest. (This did not stop the transmit-queue stalls that
# LinkStalledError reports.) The limit is read when a socket is created, so raise it before qemu starts.
LINK_DGRAM_QLEN = 1024
_QLEN_SYSCTL = Path("/proc/sys/net/unix/max_dgram_qlen")


def _widen_link_queue() -> None:
    try:
        if int(_QLEN_SYSCTL.read_text()) < LINK_DGRAM_QLEN:
            _QLEN_SYSCTL.write_text(f"{LINK_DGRAM_QLEN}\n")
    except OSError as exc:
        print(f"testbed: cannot raise {_QLEN_SYSCTL} ({exc}); the guest link may stall under load")


LINK_NIC_ID = "linknic"
# A TCG guest on a loaded host now and then locks both CPUs in its kernel for good (docs/testbed.md,
# "A guest whose kernel locks up"); the watchdog says so every ~30 s. Past this the guest is lost.
LOCKUP_SIGNATURE = re.compile(r"soft lockup - CPU#\d+ stuck for (\d+)s")
LOCKUP_KILL_SECONDS = 120
# Printed by a guest kernel once its link NIC has not sent for 5 s with packets queued.
LINK_STALL_SIGNATURE = "NETDEV WATCHDOG"


class LinkStalledError(RuntimeError):
    """The emulated link NIC of a guest stopped transmitting: the testbed failed, not the code under test.

    Seen now and then under RoCE traffic (docs/testbed.md, "The guest link's transmit queue stalls");
    the queue never recovers, so both guests are stopped at once and the run is void. The test suite
    reruns a test that raised this (pytest-rerunfailures, --only-rerun LinkStalledError).
    """


def _monitor_command(path: Path, command: str, timeout: float = 5.0) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(command.encode())
            data = b""
            deadline = time.monotonic() + timeout
            # The monitor echoes the command and prints "(qemu) " after the answer.
            while data.count(b"(qemu)") < 2 and time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        return f"(monitor {path}: {exc})"
    text = data.decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("(qemu)"))


def _wait_pair(guests: tuple[_Guest, _Guest], deadline: float) -> tuple[GuestResult, GuestResult]:
    while any(g.proc.poll() is None for g in guests) and time.monotonic() < deadline:
        stalled = [g for g in guests if g.stall_line is not None]
        if stalled:
            report = "".join(
                f"\nnode-{g.spec.node}: {g.stall_line or 'no stall seen'}\n{g.link_queue_status()}"
                for g in guests
            )
            for g in guests:
                g.kill()
            names = ", ".join(f"node-{g.spec.node}" for g in stalled)
            raise LinkStalledError(f"testbed: the guest link's transmit queue stalled on {names}{report}")
        time.sleep(0.5)
    results = guests[0].wait(deadline), guests[1].wait(deadline)
    return results


def run_pair(
    spec_a: GuestSpec, spec_b: GuestSpec, timeout: float = 600.0, echo: bool = False
) -> tuple[GuestResult, GuestResult]:
    """Boot node A (10.77.0.1) and node B (10.77.0.2) joined by a private link; run both.

    Raises LinkStalledError as soon as either guest's link NIC stops transmitting.
    """
    kind = os.environ.get("IBCKPT_GUEST_LINK", "stream")
    if kind not in ("stream", "dgram"):
        raise ValueError(f"IBCKPT_GUEST_LINK must be stream or dgram, not {kind!r}")
    if kind == "dgram":
        _widen_link_queue()
    with _job_root() as root:
        # Copies: the caller may pass one spec for both nodes.
        spec_a = dataclasses.replace(spec_a, node=1, link=True, cpus=1)
        spec_b = dataclasses.replace(spec_b, node=2, link=True, cpus=1)
        deadline = time.monotonic() + timeout
        a = b = None
        try:
            if kind == "stream":
                # One connection: node A listens, node B connects once the socket exists (qemu
                # 7.2's client does not retry). The stream carries each frame with its length.
                sock = root / "link.sock"
                a = _Guest(spec_a, root, f"stream,server=on,addr.type=unix,addr.path={sock}", echo)
                _wait_for_socket(sock, a, min(deadline, time.monotonic() + LINK_LISTEN_S))
                b = _Guest(spec_b, root, f"stream,server=off,addr.type=unix,addr.path={sock}", echo)
            else:
                sock_a, sock_b = root / "link-a.sock", root / "link-b.sock"
                dgram = "dgram,local.type=unix,local.path={},remote.type=unix,remote.path={}"
                a = _Guest(spec_a, root, dgram.format(sock_a, sock_b), echo)
                b = _Guest(spec_b, root, dgram.format(sock_b, sock_a), echo)
            result_a, result_b = _wait_pair((a, b), deadline)
        finally:
            for g in (a, b):
                if g is not None and g.proc.poll() is None:
                    g.kill()
        return result_a, result_b


def _stream(sock: Path, server: bool) -> str:
    return f"stream,server={'on' if server else 'off'},addr.type=unix,addr.path={sock}"


class GuestPair:
    """Two linked guests that run until stopped (the cluster's nodes), not until a command ends.

    node-2 listens on the link and node-1 connects: qemu's stream server takes a new connection once its
    client is gone, so node-1 can be killed hard and replaced by a fresh guest (`replace`). With
    `devices=2` the guests get a second link the same way, for rxe1 (several HCAs per node)."""

    def __init__(self, spec_a: GuestSpec, spec_b: GuestSpec, echo: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ibckpt-pair-"))
        self.echo = echo
        spec_a = dataclasses.replace(spec_a, node=1, link=True)
        spec_b = dataclasses.replace(spec_b, node=2, link=True)
        self.sock = self.root / "link.sock"
        self.sock2 = self.root / "link2.sock" if spec_a.devices == 2 else None
        self.guests: list[_Guest] = []
        self.boots = 0
        try:
            self._boot(spec_a, spec_b)
        except BaseException:
            self.stop()
            raise

    def _boot(self, spec_a: GuestSpec, spec_b: GuestSpec) -> None:
        self.boots += 1
        root = self.root / f"boot{self.boots}"
        root.mkdir()
        self.sock.unlink(missing_ok=True)
        link2 = None
        if self.sock2 is not None:
            self.sock2.unlink(missing_ok=True)
            link2 = _stream(self.sock2, server=True)
        b = _Guest(spec_b, root, _stream(self.sock, server=True), self.echo, link2)
        self.guests = [b]
        for sock in (self.sock, self.sock2):
            if sock is not None:
                _wait_for_socket(sock, b, time.monotonic() + LINK_LISTEN_S)
        self.guests.insert(0, self._connect(spec_a))  # guests[i] is node-(i+1)

    def _connect(self, spec: GuestSpec) -> _Guest:
        self.boots += 1
        root = self.root / f"boot{self.boots}"  # a fresh job dir for each guest started
        root.mkdir()
        link2 = _stream(self.sock2, server=False) if self.sock2 is not None else None
        return _Guest(spec, root, _stream(self.sock, server=False), self.echo, link2)

    def kill(self, node: int) -> None:
        """Kill a node's qemu at once: no shutdown inside the guest, as a host that loses power."""
        self.guests[node - 1].kill()

    def replace(self, node: int) -> None:
        """Boot a fresh guest for node-1 (its memory, and so its node's state, starts empty)."""
        if node != 1:
            raise ValueError("only node-1, the link's client, can be replaced")
        old = self.guests[0]
        if old.proc.poll() is None:
            old.kill()
        self.guests[0] = self._connect(old.spec)

    def reboot(self) -> None:
        """Boot both guests afresh (node-2 serves the link, so it cannot be replaced alone)."""
        specs = [g.spec for g in self.guests]
        for g in self.guests:
            if g.proc.poll() is None:
                g.kill()
        self._boot(*specs)

    def started(self, node: int) -> float:
        return self.guests[node - 1].started

    def console(self, node: int) -> str:
        return self.guests[node - 1].buffer.getvalue()

    def running(self, node: int) -> bool:
        return self.guests[node - 1].proc.poll() is None

    def dead(self) -> list[str]:
        """What each guest that is no longer running printed last."""
        return [
            f"node-{g.spec.node} exited ({g.proc.returncode}):\n{g.buffer.getvalue()[-3000:]}"
            for g in self.guests
            if g.proc.poll() is not None
        ]

    def stop(self) -> None:
        for g in self.guests:
            if g.proc.poll() is None:
                g.kill()
        shutil.rmtree(self.root, ignore_errors=True)


# How long the listening node's qemu may take to start listening on the link socket.
LINK_LISTEN_S = 30.0


def _wait_for_socket(path: Path, guest: _Guest, deadline: float) -> None:
    while not path.exists():
        if guest.proc.poll() is not None:
            raise RuntimeError(
                f"testbed: node-{guest.spec.node}'s qemu exited before it listened on {path}:\n"
                f"{guest.buffer.getvalue()[-2000:]}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"testbed: node-{guest.spec.node}'s qemu did not listen on {path} in {LINK_LISTEN_S:g}s"
            )
        time.sleep(0.02)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.guest", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="boot a guest and run a shell command in it")
    run_p.add_argument("--timeout", type=float, default=600.0)
    run_p.add_argument("--two", action="store_true", help="boot two linked guests; command runs on both")
    run_p.add_argument(
        "--forward", type=int, action="append", default=[], help="host loopback port to expose"
    )
    run_p.add_argument("--devices", type=int, choices=(1, 2), default=1, help="Soft-RoCE devices")
    run_p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = " ".join(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if args.two:
        ra, rb = run_pair(
            GuestSpec(command, forward_ports=args.forward, cwd=Path.cwd(), devices=args.devices),
            GuestSpec(command, forward_ports=args.forward, cwd=Path.cwd(), devices=args.devices),
            timeout=args.timeout,
            echo=True,
        )
        return ra.returncode or rb.returncode
    spec = GuestSpec(command, forward_ports=args.forward, cwd=Path.cwd(), devices=args.devices)
    result = run(spec, timeout=args.timeout, echo=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
