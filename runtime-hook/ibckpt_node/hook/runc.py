"""`ibckpt-runc`: containerd's (or CRI-O's, or podman's) runc for the `ibckpt` runtime handler.

`create` and `run` first edit the bundle's config.json for a container that goes under the shim
(oci.edit_spec: the shim file, LD_PRELOAD, the control and coordinator directories, the hook),
then exec the real runc with the arguments untouched. Every other subcommand is an exec of runc
and nothing else. The real runc is `runc` in /etc/ibckpt/node.json, or $IBCKPT_RUNC.

Restore seam: the `create` of a container whose pod carries `ibckpt.io/restore-from:
NAMESPACE/CHECKPOINT` becomes `runc restore --detach` from the images the node agent staged in
STATE_DIR/restore/POD_UID/CONTAINER (restore.check refuses anything else); the `start` that
follows is then answered here, since the container already runs.
"""

from __future__ import annotations

import os
import sys

# Passing through (most calls) needs neither json nor the spec code: they are imported on create.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from ibckpt_node.hook import oci

# runc's global flags that take a value (as `--flag value`, `--flag=value`, or with one dash)
GLOBAL_VALUE_FLAGS = frozenset({"root", "log", "log-format", "criu", "rootless"})
# create's and run's flags that take a value; every other flag of theirs is a boolean
CREATE_VALUE_FLAGS = frozenset({"bundle", "b", "console-socket", "pid-file", "preserve-fds"})
# what restore also understands of create's options
RESTORE_KEEPS = frozenset({"bundle", "b", "console-socket", "pid-file", "no-pivot"})
RESTORED_MARK = "restored"


def _flag(arg: str) -> tuple[str, str | None]:
    name, eq, value = arg.lstrip("-").partition("=")
    return name, (value if eq else None)


def find_command(argv: list[str]) -> int | None:
    """Index of the subcommand in runc's argv (after the global flags), or None."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not arg.startswith("-") or arg == "-":
            return i
        name, value = _flag(arg)
        i += 2 if value is None and name in GLOBAL_VALUE_FLAGS else 1
    return None


class CreateArgs:
    """create's (or run's) own arguments: flags, then the container id."""

    def __init__(self, args: list[str]) -> None:
        self.options: list[tuple[str, str | None, list[str]]] = []  # (name, value, raw tokens)
        self.container_id = ""
        i = 0
        while i < len(args):
            arg = args[i]
            if arg.startswith("-") and arg != "-" and not self.container_id:
                name, value = _flag(arg)
                raw = [arg]
                if value is None and name in CREATE_VALUE_FLAGS and i + 1 < len(args):
                    value = args[i + 1]
                    raw.append(value)
                    i += 1
                self.options.append((name, value, raw))
            elif not self.container_id:
                self.container_id = arg
            i += 1

    def value(self, *names: str) -> str | None:
        for name, value, _ in self.options:
            if name in names:
                return value
        return None

    @property
    def bundle(self) -> str:
        return self.value("bundle", "b") or os.getcwd()


def log_error(global_args: list[str], message: str) -> None:
    """Say why on stderr and in runc's --log file, where containerd reads a failed create's reason."""
    import json
    import time

    print(f"ibckpt-runc: {message}", file=sys.stderr)
    log_file = fmt = None
    for i, arg in enumerate(global_args):
        name, value = _flag(arg)
        if value is None and i + 1 < len(global_args):
            value = global_args[i + 1]
        if name == "log":
            log_file = value
        elif name == "log-format":
            fmt = value
    if not log_file:
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if fmt == "json":
        line = json.dumps({"level": "error", "msg": f"ibckpt-runc: {message}", "time": stamp})
    else:
        line = f'time="{stamp}" level=error msg="ibckpt-runc: {message}"'
    try:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def global_value(global_args: list[str], wanted: str) -> str | None:
    for i, arg in enumerate(global_args):
        name, value = _flag(arg)
        if name == wanted:
            return value if value is not None else (global_args[i + 1] if i + 1 < len(global_args) else None)
    return None


RUNTIME_RECORD = "runtime.json"


def prepare(config: oci.NodeConfig, args: CreateArgs, runc_root: str | None = None) -> tuple[str, str] | None:
    """Edit the bundle for the shim if the container wants it. Returns (image dir, staged restore
    options) when the create is to be a restore. Records the runtime's state root beside the
    container's control dir: the agent checkpoints the container through the same runc and root."""
    import json

    from ibckpt_node.hook import oci
    from ibckpt_node.hook.oci import Refused

    path = os.path.join(args.bundle, "config.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    restore: tuple[str, str] | None = None
    shim: str | None = None  # a restore's recorded build; None: the node's current one
    reason = oci.wants_shim(spec)
    # the pod's sandbox (pause) carries the pod's annotations too: it is created, never restored
    if oci.ANN_RESTORE in oci.annotations_of(spec) and not oci.identity(spec).sandbox:
        from ibckpt_node.hook import restore as restore_mod

        images, extra, shim = restore_mod.check(config, spec)
        restore = (images, extra)
        reason = reason or "restore"
    if reason is None:
        return None
    container_id = oci.checked_id(args.container_id)
    if shim is None and not os.path.isfile(config.shim):
        raise Refused(f"{container_id} ({reason}): the shim {config.shim} is missing on this node")
    cdir = config.container_dir(container_id)
    ctl = os.path.join(cdir, "ctl")
    os.makedirs(cdir, mode=0o700, exist_ok=True)
    os.makedirs(ctl, mode=0o700, exist_ok=True)
    # the container's own coordinator directory: root's, so it can plant nothing where the agent listens
    os.makedirs(config.coord_dir(container_id), mode=0o755, exist_ok=True)
    uid, gid = oci.process_owner(spec)
    os.chown(ctl, uid, gid)  # the shim runs as the container's user and binds its socket here
    record = {"runc": config.runc, "root": runc_root or "", "bundle": os.path.abspath(args.bundle)}
    with open(os.path.join(cdir, RUNTIME_RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f)
    edited = oci.edit_spec(spec, config, container_id, shim)
    tmp = path + ".ibckpt.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(edited, f)
    os.chmod(tmp, os.stat(path).st_mode & 0o7777)
    os.replace(tmp, path)
    return restore


def bundle_spec(bundle: str) -> dict[str, Any]:
    import json

    with open(os.path.join(bundle, "config.json"), encoding="utf-8") as f:
        spec: dict[str, Any] = json.load(f)
    return spec


def rootfs_of(bundle: str, spec: dict[str, Any]) -> str:
    path = str(spec.get("root", {}).get("path", "rootfs"))
    return path if os.path.isabs(path) else os.path.join(bundle, path)


def restore_argv(global_args: list[str], args: CreateArgs, images: str, extra: str) -> list[str]:
    argv = [*global_args, "restore", "--detach", "--image-path", images]
    for name, _, raw in args.options:
        if name in RESTORE_KEEPS:
            argv += raw
    argv += extra.split() if extra else []
    return [*argv, args.container_id]


RESTORE_LOCK_WAIT_S = 300.0


def network_of(spec: dict[str, Any]) -> str:
    """The network namespace the container runs in, as the identity of the namespace itself: containerd
    joins a pod's containers to `/proc/<its pause pid>/ns/net`, a different path for every pod even when
    all are the node's namespace (hostNetwork), so the path names nothing; its inode does. "own" for a
    namespace the container creates."""
    path = "/proc/self/ns/net"  # no network namespace in the spec: the runtime's, the node's
    for ns in spec.get("linux", {}).get("namespaces") or ():
        if ns.get("type") == "network":
            if not ns.get("path"):
                return "own"
            path = str(ns["path"])
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"netns:{st.st_dev}:{st.st_ino}"


def restore_lock_path(config: oci.NodeConfig, network: str) -> str:
    import hashlib

    digest = hashlib.sha256(network.encode()).hexdigest()[:16]
    return os.path.join(config.state_dir, "locks", f"restore-{digest}")


def hold_restore_lock(config: oci.NodeConfig, network: str, wait_s: float = RESTORE_LOCK_WAIT_S) -> int:
    """One CRIU restore at a time per network namespace, as a held flock (the fd; closing it releases).
    Two restores in one namespace collide: CRIU names its fd-transport sockets after the restored pid
    (abstract unix sockets, scoped by network namespace; every container's first task is pid 1), and both
    lock the same namespace's iptables. hostNetwork pods on one node, and the containers of one pod, share
    a namespace; containerd creates them in parallel."""
    import fcntl
    import time

    from ibckpt_node.hook.oci import Refused

    if network == "own":  # a namespace of its own, nobody else's restore can be in it
        return -1
    path = restore_lock_path(config, network)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise Refused(
                    f"another restore in network namespace {network} held {path} for {wait_s:g}s"
                ) from None
            time.sleep(0.2)


def run_restore(
    config: oci.NodeConfig, global_args: list[str], argv: list[str], images: str, network: str
) -> int:
    """`runc restore --detach` as a child, not an exec, under the network namespace's restore lock: when it
    fails, CRIU's own error lines from its restore log go into runc's --log file after runc's, where
    containerd (and so `kubectl describe pod`) reads the reason. The restored process is reparented to
    containerd's shim (a subreaper)."""
    import subprocess

    from ibckpt_node.hook.oci import Refused

    try:
        lock = hold_restore_lock(config, network)
    except Refused as exc:
        log_error(global_args, str(exc))
        return 1
    try:
        status = subprocess.run([config.runc, *argv], check=False).returncode
    finally:
        if lock >= 0:
            os.close(lock)
    if status != 0:
        from ibckpt_node.hook import restore as restore_mod

        said = restore_mod.criu_errors(images)
        log_error(global_args, f"runc restore failed (status {status}); CRIU: {said or 'no error logged'}")
    return status


def exec_runc(config: oci.NodeConfig, argv: list[str]) -> NoReturn:
    os.execv(config.runc, [config.runc, *argv])


def main(default_runc: str | None = None) -> int:
    """default_runc: the runc the installer found in the node's config when it wrote the launcher,
    so that passing through reads no config file."""
    argv = sys.argv[1:]
    at = find_command(argv)
    command = argv[at] if at is not None else ""
    runc = os.environ.get("IBCKPT_RUNC") or default_runc
    if runc and command not in ("create", "run", "start"):
        os.execv(runc, [runc, *argv])
    if runc and at is not None and command in ("create", "run") and plain(CreateArgs(argv[at + 1 :]).bundle):
        os.execv(runc, [runc, *argv])
    return _main(argv, at, command)


def plain(bundle: str) -> bool:
    """Whether config.json's bytes show the container cannot be ours (the hook's fast path)."""
    from ibckpt_node.hook.main import plain_bundle

    return plain_bundle(bundle)


def _main(argv: list[str], at: int | None, command: str) -> int:
    from ibckpt_node.hook import oci
    from ibckpt_node.hook.oci import Refused

    try:
        config = oci.load_config()
    except ValueError as exc:
        print(f"ibckpt-runc: {exc}", file=sys.stderr)
        return 1
    runc = os.environ.get("IBCKPT_RUNC")
    if runc:
        config.runc = runc
    if at is None or command not in ("create", "run", "start"):
        exec_runc(config, argv)
    global_args = argv[:at]
    args = CreateArgs(argv[at + 1 :])
    if command == "start":
        mark = os.path.join(config.container_dir(args.container_id or "-"), RESTORED_MARK)
        if args.container_id and os.path.exists(mark):
            os.unlink(mark)  # restore --detach left it running: nothing to start
            return 0
        exec_runc(config, argv)
    try:
        restore = prepare(config, args, global_value(global_args, "root"))
    except (Refused, ValueError, OSError) as exc:
        log_error(global_args, str(exc))
        return 1
    if restore is not None:
        if command != "create":
            log_error(global_args, f"{args.container_id}: a restore needs create/start, not {command}")
            return 1
        images, extra = restore
        try:
            from ibckpt_node.hook import restore as restore_mod

            spec = bundle_spec(args.bundle)
            restore_mod.apply_rootfs_diff(images, rootfs_of(args.bundle, spec))
            restore_mod.apply_shm(images, spec)
        except (Refused, ValueError, OSError) as exc:
            log_error(global_args, str(exc))
            return 1
        mark = os.path.join(config.container_dir(args.container_id), RESTORED_MARK)
        with open(mark, "w", encoding="utf-8") as f:
            f.write(images + "\n")
        argv = restore_argv(global_args, args, images, extra)
        return run_restore(config, global_args, argv, images, network_of(spec))
    exec_runc(config, argv)


if __name__ == "__main__":
    sys.exit(main())
