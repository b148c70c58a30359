"""Which RDMA device a restored rank gets for each device it used: the one rule the node agent applies
before a rebuild and the operator checks before it creates a restored pod (docs/rdma-pods.md).

Devices are HCA names (sysfs `ibdev`, e.g. mlx5_0). A container is *allocated* devices (its OCI
config's /dev/infiniband/uverbsN nodes, in that order); its ranks *use* some of them. For each device
a rank used, the new one is, first match wins:

1. the operator's explicit map (RestoreJob spec.deviceMap), old name -> new name;
2. the same name, if the new container was given a device of that name;
3. the device at the same position among the new container's allocated devices as the old device
   had among the old container's (old allocation order -> new allocation order);
4. none: the restore is refused with a message naming the device and what the container was given.

Pure (no I/O): the operator's machines may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class DeviceMapError(ValueError):
    """No device of the new container fits a device a rank used; the message says which and why."""


def device_map(
    used: Sequence[str],
    old_allocated: Sequence[str],
    new_allocated: Sequence[str],
    explicit: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Old device name -> new device name for each device in `used` (by the rule above), identity
    pairs included; DeviceMapError if a device maps to none, or two devices to one."""
    explicit = explicit or {}
    mapped: dict[str, str] = {}
    for old in dict.fromkeys(used):  # in order, once each
        if old in explicit:
            new = explicit[old]
            if new not in new_allocated:
                raise DeviceMapError(
                    f"the device map sends {old} to {new}, which the container was not given "
                    f"(it was given {_listed(new_allocated)})"
                )
        elif old in new_allocated:
            new = old
        elif old in old_allocated and old_allocated.index(old) < len(new_allocated):
            new = new_allocated[old_allocated.index(old)]
        else:
            where = (
                f"position {old_allocated.index(old)} of {_listed(old_allocated)}"
                if old in old_allocated
                else "no recorded allocation"
            )
            raise DeviceMapError(
                f"device {old} ({where}) has no counterpart: the container was given "
                f"{_listed(new_allocated)}; name one in the RestoreJob's deviceMap"
            )
        mapped[old] = new
    taken: dict[str, str] = {}
    for old, new in mapped.items():
        if new in taken:
            raise DeviceMapError(f"devices {taken[new]} and {old} would both become {new}")
        taken[new] = old
    return mapped


def renames(mapping: Mapping[str, str]) -> dict[str, str]:
    """The pairs of `mapping` that change a name: what a rank's shim needs to be told (it keeps a
    device's name by itself, so a shim too old for `devmap` restores when nothing is renamed)."""
    return {old: new for old, new in mapping.items() if old != new}


def unfit(used: Sequence[str], node_devices: Sequence[str], explicit: Mapping[str, str] | None = None) -> str:
    """Why a container whose ranks used `used` cannot be restored on a node with `node_devices`, or ""
    when it may be: the operator's check before it creates a pod (the agent's device_map decides the
    pairs once it knows what the new container was given)."""
    explicit = explicit or {}
    distinct = list(dict.fromkeys(used))
    missing = sorted({new for old, new in explicit.items() if old in distinct and new not in node_devices})
    if missing:
        return f"the deviceMap names {_listed(missing)}, not among the node's {_listed(node_devices)}"
    if len(distinct) > len(node_devices):
        return (
            f"its ranks used {len(distinct)} RDMA devices ({_listed(distinct)}), "
            f"the node has {len(node_devices)} ({_listed(node_devices)})"
        )
    return ""


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"
