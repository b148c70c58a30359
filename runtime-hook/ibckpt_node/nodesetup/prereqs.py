"""Node prerequisites: pure decisions over what the driver found on the node (nodesetup/host.py).

Each check gives a Finding; the agent is Ready only when none is missing, and its log and the Event on
its Node name every missing one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ibckpt_node.criu import parse_version

MIN_CRIU = (3, 17, 0)
MIN_PYTHON = (3, 9)
# What CRIU needs of the kernel, seen from /proc (CONFIG_CHECKPOINT_RESTORE, CONFIG_NAMESPACES and
# the rest `criu check` tests first): a missing one fails every dump.
KERNEL_PATHS = {
    "/proc/sys/kernel/ns_last_pid": "CONFIG_CHECKPOINT_RESTORE (CRIU sets pids through ns_last_pid)",
    "/proc/self/map_files": "CONFIG_CHECKPOINT_RESTORE (CRIU reads mappings through map_files)",
    "/proc/self/ns/pid": "CONFIG_PID_NS",
    "/proc/self/ns/mnt": "mount namespaces",
}


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.name}: {self.detail}"


def executable(name: str, path: str, exists: bool, is_executable: bool) -> Finding:
    if not exists:
        return Finding(name, False, f"{path} does not exist on the node")
    if not is_executable:
        return Finding(name, False, f"{path} is not executable")
    return Finding(name, True, path)


def criu(returncode: int | None, output: str) -> Finding:
    """returncode None: criu could not be started (not on the node's PATH)."""
    if returncode is None:
        return Finding("criu", False, f"not found on the node's PATH ({output.strip() or 'no criu'})")
    found = parse_version(output)
    if returncode != 0 or found is None:
        return Finding(
            "criu", False, f"`criu --version` failed (status {returncode}): {output.strip()[:200]}"
        )
    text = ".".join(map(str, found))
    if found < MIN_CRIU:
        return Finding("criu", False, f"version {text} is older than {'.'.join(map(str, MIN_CRIU))}")
    return Finding("criu", True, f"version {text}")


def python(path: str, returncode: int | None, output: str) -> Finding:
    """The node's python3, the hook's and the wrapper's interpreter: `python3 -c` printing `3 11`."""
    name = "node python3"
    if returncode is None:
        return Finding(name, False, f"{path} cannot run on the node ({output.strip() or 'missing'})")
    parts = output.split()
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return Finding(name, False, f"{path} did not say its version (status {returncode}): {output[:200]}")
    if found < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Finding(name, False, f"{path} is Python {found[0]}.{found[1]}, older than {need}")
    return Finding(name, True, f"{path} (Python {found[0]}.{found[1]})")


def kernel(present: dict[str, bool]) -> list[Finding]:
    return [
        Finding(f"kernel: {feature}", present.get(path, False), path if present.get(path) else f"no {path}")
        for path, feature in KERNEL_PATHS.items()
    ]


def missing(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if not f.ok]


def summary(node: str, findings: list[Finding]) -> str:
    """One line for the log and the Event: every missing prerequisite, or that none is."""
    gone = missing(findings)
    if not gone:
        return f"node {node} has every prerequisite of the ibckpt agent"
    return f"node {node} lacks what the ibckpt agent needs: " + "; ".join(f.line() for f in gone)
