"""OCI specs shaped as the engines write them, for the hook's tests."""

from __future__ import annotations

from typing import Any


def containerd_spec(**annotations: str) -> dict[str, Any]:
    """A container spec shaped as containerd 1.6's CRI plugin writes it (trimmed)."""
    ann = {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": "trainer",
        "io.kubernetes.cri.sandbox-id": "f" * 64,
        "io.kubernetes.cri.sandbox-name": "job-0",
        "io.kubernetes.cri.sandbox-namespace": "ml",
        "io.kubernetes.cri.sandbox-uid": "0b9e2d1c-1111-4222-8333-444455556666",
        "io.kubernetes.cri.image-name": "app:1",
    }
    ann.update(annotations)
    return {
        "ociVersion": "1.0.2-dev",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/app"], "env": ["PATH=/usr/bin", "HOME=/root"]},
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "annotations": ann,
        "linux": {"devices": [], "namespaces": [{"type": "pid"}, {"type": "mount"}]},
    }


def with_device(spec: dict[str, Any], path: str = "/dev/infiniband/uverbs0") -> dict[str, Any]:
    spec["linux"]["devices"].append({"path": path, "type": "c", "major": 231, "minor": 192})
    return spec
