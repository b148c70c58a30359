"""A restore's device maps: each restored rank is told, before it rebuilds, which of its new
container's RDMA devices replaces each device it used (ibckpt/devicemap.py has the rule).

A container whose checkpoint recorded no devices (taken before they were recorded), or whose new
spec cannot be read, is told nothing: its shim's own rule applies (same name, else same index).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ibckpt.devicemap import DeviceMapError
from ibckpt_native.control import ControlError
from ibckpt_node import rdma_devices
from ibckpt_node.container_runtime import RuntimeContainer
from ibckpt_node.criu import CriuError
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import RegisteredContainer

log = logging.getLogger(__name__)


class DeviceRestoreError(Exception):
    """A restored container's devices cannot be mapped, or a rank refused its map; says which."""


@dataclass(frozen=True)
class Recorded:
    """What the checkpoint recorded of one container's devices (the manifest's ContainerDevices)."""

    where: str  # the restored container, for messages: NAMESPACE/POD container NAME
    pod_uid: str
    container: str
    allocated: tuple[str, ...]
    used: Mapping[str, Sequence[str]]  # rank key -> devices, in context order


def new_allocation(entry: RegisteredContainer, sysfs: Path = rdma_devices.VERBS_SYSFS) -> list[str] | None:
    """The devices the restored container was given (rdma_devices.allocation), None if unknown."""
    try:
        container = RuntimeContainer.recorded(entry.container_id, Path(entry.control_dir).parent)
    except CriuError:
        return None
    given = rdma_devices.container_allocation(container, sysfs)
    return None if given is None else given[0]


def plan_maps(
    recorded: Sequence[Recorded],
    given: Mapping[tuple[str, str], Sequence[str] | None],
    explicit: Mapping[str, str] | None,
) -> dict[str, dict[str, str]]:
    """Each rank's renames, by rank key, from what each container recorded and what its restored one
    was `given` (by (pod uid, container); None: unknown, then nothing is mapped for it)."""
    maps: dict[str, dict[str, str]] = {}
    for item in recorded:
        new = given.get((item.pod_uid, item.container))
        if new is None:
            if item.used:
                log.warning("%s: its devices are unknown; its ranks keep their shims' own rule", item.where)
            continue
        try:
            maps |= rdma_devices.rank_maps(item.used, item.allocated, new, explicit, item.where)
        except DeviceMapError as exc:
            raise DeviceRestoreError(f"no device map fits: {exc}") from None
    return maps


async def apply(
    recorded: Sequence[Recorded],
    entries: Sequence[RegisteredContainer],
    ranks: Sequence[LocalRank],
    explicit: Mapping[str, str] | None,
    timeout_s: float,
    sysfs: Path = rdma_devices.VERBS_SYSFS,
) -> None:
    """Compute every restored rank's map and send it, before any rank rebuilds."""
    wanted = {(item.pod_uid, item.container) for item in recorded if item.used}
    found = [e for e in entries if (e.pod_uid, e.container) in wanted]
    allocations = await asyncio.gather(*(asyncio.to_thread(new_allocation, e, sysfs) for e in found))
    given = {(e.pod_uid, e.container): a for e, a in zip(found, allocations, strict=True)}
    maps = plan_maps(recorded, given, explicit)
    try:
        await rdma_devices.send_maps(ranks, maps, timeout_s)
    except (ControlError, OSError) as exc:
        raise DeviceRestoreError(f"{rdma_devices.MAP_REFUSED}: {exc}") from None
