"""A container's RDMA devices as a checkpoint records them and a restore maps them (docs/rdma-pods.md).

A device plugin gives a container /dev/infiniband/uverbsN nodes (its OCI config's linux.devices);
/sys/class/infiniband_verbs/uverbsN/ibdev names the HCA behind each. What a container was *given*
is those names in the config's order; a container that mounts the whole /dev/infiniband (a hostPath,
privileged or not) was given every device of its node, in uverbs order, and is marked `whole_node`.
What its ranks *use* is each shim's `status` contexts, in the order they were opened.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ibckpt.devicemap import DeviceMapError, device_map, renames
from ibckpt_native.control import ControlError
from ibckpt_node import container_runtime, devmap
from ibckpt_node.hook.oci import RDMA_DEV_PREFIX
from ibckpt_node.ranks import LocalRank

log = logging.getLogger(__name__)

VERBS_SYSFS = Path("/sys/class/infiniband_verbs")
# why a restore fails when send_maps meets a shim that would not take its map
MAP_REFUSED = "a rank refused its device map (a shim without devmap?)"
_UVERBS = re.compile(r"^uverbs([0-9]+)$")


def given_nodes(spec: Mapping[str, Any]) -> tuple[list[str], bool]:
    """(the uverbsN nodes the spec's linux.devices gives, in its order; whether a mount brings the whole
    /dev/infiniband, or /dev, in)."""
    nodes = []
    for dev in (spec.get("linux") or {}).get("devices") or []:
        path = str(dev.get("path", ""))
        name = path.removeprefix(RDMA_DEV_PREFIX + "/")
        if name != path and _UVERBS.match(name) and name not in nodes:
            nodes.append(name)
    whole = any(
        str(mount.get("destination", "")).rstrip("/") in (RDMA_DEV_PREFIX, "/dev")
        and mount.get("type") != "tmpfs"  # a fresh /dev of the runtime's holds only what devices lists
        for mount in spec.get("mounts") or []
    )
    return nodes, whole


def ibdev(node: str, sysfs: Path = VERBS_SYSFS) -> str | None:
    """The HCA name behind a uverbs node; None if this node has no such device."""
    try:
        return (sysfs / node / "ibdev").read_text().strip() or None
    except OSError:
        return None


def node_devices(sysfs: Path = VERBS_SYSFS) -> list[str]:
    """Every HCA of this node, in uverbs order."""
    try:
        nodes = [p.name for p in sysfs.iterdir() if _UVERBS.match(p.name)]
    except OSError:
        return []
    nodes.sort(key=lambda name: int(name.removeprefix("uverbs")))
    return [name for name in (ibdev(n, sysfs) for n in nodes) if name]


def allocation(spec: Mapping[str, Any] | None, sysfs: Path = VERBS_SYSFS) -> tuple[list[str], bool] | None:
    """(the HCA names a container with this spec was given, in order; whether that is its node's
    whole set), or None when its spec could not be read."""
    if spec is None:
        return None
    nodes, whole = given_nodes(spec)
    if whole:
        return node_devices(sysfs), True
    return [name for name in (ibdev(n, sysfs) for n in nodes) if name], False


def container_allocation(
    container: container_runtime.RuntimeContainer | None, sysfs: Path = VERBS_SYSFS
) -> tuple[list[str], bool] | None:
    """allocation() of a container the runtime wrapper created, from its bundle on the node."""
    return allocation(container_runtime.bundle_spec(container) if container is not None else None, sysfs)


async def used_devices(ranks: Sequence[LocalRank], timeout_s: float) -> dict[str, list[str]]:
    """Each rank's devices, in its contexts' order, from its shim's `status`; a rank that does not
    answer (the preflight refuses it anyway) or whose shim predates `contexts` is left out."""

    async def one(r: LocalRank) -> tuple[str, list[str]] | None:
        try:
            status = await r.shim.status(timeout_s)
        except (ControlError, OSError) as exc:
            log.warning("%s: no device list from its status: %s", r.rank.key(), exc)
            return None
        return (r.rank.key(), [name for name, _ in status.contexts]) if status.contexts else None

    found = await asyncio.gather(*(one(r) for r in ranks))
    return dict(pair for pair in found if pair is not None)


def rank_maps(
    used: Mapping[str, Sequence[str]],
    old_allocated: Sequence[str],
    new_allocated: Sequence[str],
    explicit: Mapping[str, str] | None,
    where: str,
) -> dict[str, dict[str, str]]:
    """Each rank's renames (devicemap.device_map without its identity pairs), by rank key;
    DeviceMapError naming `where` (the restored container) when a device has no counterpart."""
    maps = {}
    for key, devices in used.items():
        try:
            maps[key] = renames(device_map(devices, old_allocated, new_allocated, explicit))
        except DeviceMapError as exc:
            raise DeviceMapError(f"{where}, rank {key}: {exc}") from None
    return maps


async def send_maps(
    ranks: Sequence[LocalRank], maps: Mapping[str, Mapping[str, str]], timeout_s: float
) -> None:
    """Give each rank its map before it rebuilds; a rank with nothing renamed is told nothing (its shim
    may predate `devmap`, and keeps names by itself)."""

    async def one(r: LocalRank) -> None:
        mapping = maps.get(r.rank.key())
        if mapping:
            await devmap.send(r.shim, mapping, timeout_s)
            pairs = ", ".join(f"{old}->{new}" for old, new in mapping.items())
            log.info("%s: devices mapped %s", r.rank.key(), pairs)

    await asyncio.gather(*(one(r) for r in ranks))


async def map_by_hand(
    ranks: Sequence[LocalRank], explicit: Mapping[str, str], timeout_s: float, sysfs: Path = VERBS_SYSFS
) -> None:
    """`ibckpt-node restore --device-map`: the restored ranks' maps by the same rule, with this node's
    devices as the allocation (a process outside a container may open any of them); DeviceMapError
    naming the rank when a device it used has no counterpart here."""
    here = node_devices(sysfs)
    maps = {}
    for key, devices in (await used_devices(ranks, timeout_s)).items():
        try:
            maps[key] = renames(device_map(devices, [], here, explicit))
        except DeviceMapError as exc:
            raise DeviceMapError(f"rank {key}: {exc} (ibckpt-node: --device-map OLD=NEW)") from None
    await send_maps(ranks, maps, timeout_s)


async def record(
    trees: Sequence[tuple[str, container_runtime.RuntimeContainer | None]],
    tree_keys: Mapping[str, Sequence[str]],
    ranks: Sequence[LocalRank],
    timeout_s: float,
    sysfs: Path = VERBS_SYSFS,
) -> dict[str, dict[str, Any]]:
    """What a checkpoint records of each tree's (container's) devices, by tree name, in the fields of
    the manifest's ContainerDevices; read before the cut (a Stop dump ends the container). A tree whose
    spec cannot be read and whose ranks said nothing is left out: its restore maps nothing."""
    used = await used_devices(ranks, timeout_s)
    found = {}
    for name, container in trees:
        given = await asyncio.to_thread(container_allocation, container, sysfs)
        mine = {key: used[key] for key in tree_keys.get(name, ()) if key in used}
        if given is None and not mine:
            continue
        allocated, whole = given or ([], False)
        found[name] = {"allocated": allocated, "whole_node": whole, "used": mine}
    return found
