"""What a container's OCI spec says about it, and the edit that puts it under the shim.

Pure functions over the parsed config.json (a dict), so they can be tested on the host. The
edit adds, for a container that gets an RDMA device or opts in:
  - the shim as one read-only file, and LD_PRELOAD naming it (prepended to the app's own);
  - a per-container control directory (rw), where the shim creates `<pid>.sock` (IBCKPT_CTL);
  - the container's own shim-coordinator directory (IBCKPT_COORD), read-only: the agent serves
    `coord.sock` there for this container alone;
  - the `ibckpt-hook` at createRuntime and poststop, unless the engine already put it there
    (podman or CRI-O from hooks.d).
"""

from __future__ import annotations

import json
import os

# No `typing` or `dataclasses` at run time: together they cost more than the rest of the hook.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    Spec = dict[str, Any]

# Pod annotations (containerd copies them into the container's spec only when the runtime's
# `pod_annotations` lists them; CRI-O: `allowed_annotations`).
ANN_ENABLED = "ibckpt.io/enabled"  # "true": every container of the pod; "false": none
ANN_CONTAINERS = "ibckpt.io/containers"  # optional comma list: only these containers
ANN_RESTORE = "ibckpt.io/restore-from"  # "<namespace>/<checkpoint>": create restores instead

# Identity as containerd's CRI plugin (1.6) and CRI-O write it.
CRI_TYPE = "io.kubernetes.cri.container-type"
CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
CRI_POD = "io.kubernetes.cri.sandbox-name"
CRI_POD_UID = "io.kubernetes.cri.sandbox-uid"
CRI_CONTAINER = "io.kubernetes.cri.container-name"
CRIO_TYPE = "io.kubernetes.cri-o.ContainerType"
CRIO_NAMESPACE = "io.kubernetes.pod.namespace"
CRIO_POD = "io.kubernetes.pod.name"
CRIO_POD_UID = "io.kubernetes.pod.uid"
CRIO_CONTAINER = "io.kubernetes.container.name"

RDMA_DEV_PREFIX = "/dev/infiniband"

# Where things appear inside the container. Fixed, so a restored process finds them again.
IN_SHIM = "/run/ibckpt/lib/libibckpt.so"
IN_CTL_DIR = "/run/ibckpt/ctl"
IN_COORD_DIR = "/run/ibckpt/coord"
COORD_SOCKET_NAME = "coord.sock"

# Each shim build on the node: PREFIX/lib/ibckpt/builds/<sha256>/libibckpt.so, written once (hook/install.py).
SHIM_FILE = "libibckpt.so"
SHIM_BUILDS = "builds"

CONFIG_ENV = "IBCKPT_NODE_CONFIG"
DEFAULT_CONFIG_FILE = "/etc/ibckpt/node.json"
HOOK_TIMEOUT_S = 60  # seconds runc gives each of our hooks


class Refused(Exception):
    """The container must not be created (or restored); the message says why."""


class NodeConfig:
    """The node's paths. Read from /etc/ibckpt/node.json (or $IBCKPT_NODE_CONFIG) when present."""

    def __init__(
        self,
        runc: str = "/usr/sbin/runc",
        shim: str = "/usr/local/lib/ibckpt/libibckpt.so",
        hook: str = "/usr/local/bin/ibckpt-hook",
        state_dir: str = "/run/ibckpt",
        registry_timeout_s: float = 1.0,
        restore_wait_s: float = 90.0,
        config_file: str = "",  # the file these came from ("" = built-in defaults)
    ) -> None:
        self.runc = runc
        self.shim = shim
        self.hook = hook
        self.state_dir = state_dir
        self.registry_timeout_s = registry_timeout_s
        # how long a restoring create waits for the agent to stage its images (the operator creates
        # the pod once they are staged, or about 30 s before: machine/restore.py, "Overlap"); the
        # kubelet retries a create that fails
        self.restore_wait_s = restore_wait_s
        self.config_file = config_file

    @property
    def registry_socket(self) -> str:
        return os.path.join(self.state_dir, "registry.sock")

    def container_dir(self, container_id: str) -> str:
        return os.path.join(self.state_dir, "containers", container_id)

    def coord_dir(self, container_id: str) -> str:
        """Where the agent serves this container's shim-coordinator socket (`coord.sock`). Root's,
        mounted read-only: no other container sees it, and this one cannot plant anything there."""
        return os.path.join(self.container_dir(container_id), "coord")

    def restore_dir(self, namespace: str, pod: str, container: str) -> str:
        """Where the agent stages a container's images (names checked with checked_id first)."""
        return os.path.join(self.state_dir, "restore", namespace, pod, container)


_FIELDS = {
    "runc": str,
    "shim": str,
    "hook": str,
    "state_dir": str,
    "registry_timeout_s": float,
    "restore_wait_s": float,
}


def load_config(env: dict[str, str] | None = None) -> NodeConfig:
    env = dict(os.environ) if env is None else env
    path = env.get(CONFIG_ENV) or DEFAULT_CONFIG_FILE
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        if env.get(CONFIG_ENV):
            raise ValueError(f"{CONFIG_ENV}={path}: no such file") from None
        return NodeConfig()
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    unknown = set(raw) - set(_FIELDS)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    values: dict[str, Any] = {}
    for key, kind in _FIELDS.items():
        if key in raw:
            value = raw[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind):
                raise ValueError(f"{path}: {key} must be a {kind.__name__}")
            values[key] = value
    return NodeConfig(config_file=path, **values)


_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-.")


def checked_id(container_id: str) -> str:
    """A container id as runc accepts it; it names a directory, so nothing else may pass."""
    if not container_id or container_id in (".", "..") or not set(container_id) <= _ID_CHARS:
        raise ValueError(f"bad container id {container_id!r}")
    return container_id


class Identity:
    """Who a container is, from its annotations. Empty strings where the engine says nothing."""

    def __init__(self, namespace: str, pod: str, pod_uid: str, container: str, sandbox: bool) -> None:
        self.namespace = namespace
        self.pod = pod
        self.pod_uid = pod_uid
        self.container = container
        self.sandbox = sandbox

    def as_dict(self) -> dict[str, str]:
        return {
            "namespace": self.namespace,
            "pod": self.pod,
            "pod_uid": self.pod_uid,
            "container": self.container,
        }


def annotations_of(spec: Spec) -> dict[str, str]:
    raw = spec.get("annotations") or {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def identity(spec: Spec) -> Identity:
    ann = annotations_of(spec)

    def first(*keys: str) -> str:
        for key in keys:
            if ann.get(key):
                return ann[key]
        return ""

    kind = first(CRI_TYPE, CRIO_TYPE)
    return Identity(
        namespace=first(CRI_NAMESPACE, CRIO_NAMESPACE),
        pod=first(CRI_POD, CRIO_POD),
        pod_uid=first(CRI_POD_UID, CRIO_POD_UID),
        container=first(CRI_CONTAINER, CRIO_CONTAINER),
        sandbox=kind == "sandbox",
    )


SHM = "/dev/shm"
SHM_ARCHIVE = "dev-shm.tar"  # in the images: the files of the container's /dev/shm


def shm_source(spec: Spec) -> str | None:
    """The node directory bound at the container's /dev/shm: the pod sandbox's tmpfs (containerd, CRI-O)
    or a memory emptyDir mounted there. None without such a bind mount, and for a pod that shares the
    node's IPC namespace (its /dev/shm is the node's own: never archived, never written into)."""
    for mount in spec.get("mounts") or ():
        if not isinstance(mount, dict) or os.path.normpath(str(mount.get("destination", ""))) != SHM:
            continue
        options = mount.get("options") or []
        source = str(mount.get("source") or "")
        bind = mount.get("type") == "bind" or "bind" in options or "rbind" in options
        if bind and os.path.isabs(source) and os.path.normpath(source) != SHM:
            return source
        return None
    return None


def rdma_paths(spec: Spec) -> list[str]:
    """The RDMA device paths the container gets: as devices, or bind-mounted (hostPath)."""
    found: list[str] = []
    linux = spec.get("linux") or {}
    for dev in linux.get("devices") or []:
        path = str(dev.get("path", ""))
        if path.startswith(RDMA_DEV_PREFIX):
            found.append(path)
    for mount in spec.get("mounts") or []:
        for key in ("destination", "source"):
            path = str(mount.get(key, ""))
            if path == RDMA_DEV_PREFIX or path.startswith(RDMA_DEV_PREFIX + "/"):
                found.append(path)
                break
    return found


def wants_shim(spec: Spec) -> str | None:
    """Why this container goes under the shim, or None. The pod's annotations decide first."""
    ann = annotations_of(spec)
    who = identity(spec)
    if who.sandbox:
        return None  # the pause container
    enabled = ann.get(ANN_ENABLED, "").strip().lower()
    if enabled in ("false", "0", "no"):
        return None
    only = ann.get(ANN_CONTAINERS, "")
    if only and who.container not in {name.strip() for name in only.split(",")}:
        return None
    if enabled in ("true", "1", "yes"):
        return f"annotation {ANN_ENABLED}"
    devices = rdma_paths(spec)
    if devices:
        return f"RDMA device {devices[0]}"
    return None


def _host_id(mappings: list[dict[str, Any]], inner: int) -> int:
    """The host uid/gid of a container id under user-namespace mappings (identity if none)."""
    if not mappings:
        return inner
    for m in mappings:
        start, host, size = int(m.get("containerID", 0)), int(m.get("hostID", 0)), int(m.get("size", 0))
        if start <= inner < start + size:
            return host + inner - start
    raise ValueError(f"id {inner} is not mapped into the container's user namespace")


def process_owner(spec: Spec) -> tuple[int, int]:
    """Host uid and gid of the container's processes: they create the control sockets."""
    user = (spec.get("process") or {}).get("user") or {}
    linux = spec.get("linux") or {}
    uid = _host_id(linux.get("uidMappings") or [], int(user.get("uid", 0)))
    gid = _host_id(linux.get("gidMappings") or [], int(user.get("gid", 0)))
    return uid, gid


def has_hook(spec: Spec, hook_path: str) -> bool:
    hooks = spec.get("hooks") or {}
    name = os.path.basename(hook_path)
    for stage in ("createRuntime", "prestart"):
        for hook in hooks.get(stage) or []:
            if os.path.basename(str(hook.get("path", ""))) == name:
                return True
    return False


def _set_env(env: list[str], key: str, value: str) -> list[str]:
    prefix = key + "="
    return [e for e in env if not e.startswith(prefix)] + [prefix + value]


_HEX = frozenset("0123456789abcdef")


def is_build_digest(value: str) -> bool:
    """A shim build's name: the sha256 of its bytes, in lowercase hex."""
    return len(value) == 64 and set(value) <= _HEX


def build_of(shim_path: str) -> str | None:
    """The build a content-addressed shim path names (its digest), or None for any other path."""
    parent, name = os.path.split(shim_path)
    builds, digest = os.path.split(parent)
    if name != SHIM_FILE or os.path.basename(builds) != SHIM_BUILDS or not is_build_digest(digest):
        return None
    return digest


def build_path(current_shim: str, digest: str) -> str:
    """Where the node keeps build `digest`, beside the current one (node.json's `shim`): its builds
    directory, or `builds/` next to a shim installed before builds were kept."""
    if not is_build_digest(digest):
        raise ValueError(f"{digest!r} is not a shim build (a sha256 in lowercase hex)")
    if build_of(current_shim) is not None:
        builds = os.path.dirname(os.path.dirname(current_shim))
    else:
        builds = os.path.join(os.path.dirname(current_shim), SHIM_BUILDS)
    return os.path.join(builds, digest, SHIM_FILE)


def shim_source(spec: Spec) -> str | None:
    """The node file an edited spec mounts as the shim (what the container's processes map)."""
    for mount in spec.get("mounts") or []:
        if mount.get("destination") == IN_SHIM:
            source = mount.get("source")
            return source if isinstance(source, str) else None
    return None


def _add_mount(mounts: list[dict[str, Any]], mount: dict[str, Any]) -> list[dict[str, Any]]:
    # idempotent: a re-run of the edit (a retried create) replaces ours instead of stacking
    return [m for m in mounts if m.get("destination") != mount["destination"]] + [mount]


def edit_spec(spec: Spec, config: NodeConfig, container_id: str, shim: str | None = None) -> Spec:
    """Put the container under the shim: `shim` (a node path; a restore's recorded build), by default
    the node's current one. Returns the edited spec (the input is not changed)."""
    spec = json.loads(json.dumps(spec))
    process = spec.setdefault("process", {})
    env: list[str] = list(process.get("env") or [])
    preload = next((e[len("LD_PRELOAD=") :] for e in env if e.startswith("LD_PRELOAD=")), "")
    others = [p for p in preload.replace(" ", ":").split(":") if p and p != IN_SHIM]
    env = _set_env(env, "LD_PRELOAD", ":".join([IN_SHIM, *others]))
    env = _set_env(env, "IBCKPT_CTL", IN_CTL_DIR + "/%p.sock")
    env = _set_env(env, "IBCKPT_COORD", "unix:" + IN_COORD_DIR + "/" + COORD_SOCKET_NAME)
    process["env"] = env

    mounts: list[dict[str, Any]] = list(spec.get("mounts") or [])
    ro = ["rbind", "ro", "nosuid", "nodev"]
    mounts = _add_mount(
        mounts, {"destination": IN_SHIM, "type": "bind", "source": shim or config.shim, "options": ro}
    )
    mounts = _add_mount(
        mounts,
        {
            "destination": IN_CTL_DIR,
            "type": "bind",
            "source": os.path.join(config.container_dir(container_id), "ctl"),
            "options": ["rbind", "rw", "nosuid", "nodev", "noexec"],
        },
    )
    # connect() on a socket works through a read-only mount
    source = config.coord_dir(container_id)
    mounts = _add_mount(
        mounts, {"destination": IN_COORD_DIR, "type": "bind", "source": source, "options": [*ro, "noexec"]}
    )
    spec["mounts"] = mounts

    if not has_hook(spec, config.hook):
        hooks = spec.setdefault("hooks", {})
        hook_env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        if config.config_file and config.config_file != DEFAULT_CONFIG_FILE:
            hook_env.append(f"{CONFIG_ENV}={config.config_file}")
        for stage in ("createRuntime", "poststop"):
            # runc fails the create (and a restore: it runs them in CRIU's setup-namespaces) when a hook
            # runs past this; the hook bounds itself far below, but busy test nodes starved it past 10 s
            entry = {
                "path": config.hook,
                "args": ["ibckpt-hook", stage],
                "env": hook_env,
                "timeout": HOOK_TIMEOUT_S,
            }
            hooks[stage] = [*(hooks.get(stage) or []), entry]
    return spec
