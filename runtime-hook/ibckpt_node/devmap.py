"""The explicit device map the node agent may give a rank before its rebuild (docs/native-shim.md,
"Several devices per process").

A rank's shim reopens each verbs context on the device of the same name, else on the device at the
same index among those the container was given, else refuses the rebuild. Where the agent knows
better (a restore onto a node whose HCAs have other names), it sends `devmap <old> <new>` per device
first (native/src/devmap.c); `devmap -` empties the rank's map, and a rebuild that goes well empties
it too. Each context's device name and index are in the rank's `status` (`ShimStatus.contexts`).
A restore sends each rank's renames through `send` before the rank rebuilds (agent/restoredevices.py,
the rule in ibckpt/devicemap.py); a rank whose devices keep their names is sent nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from ibckpt_native.control import AsyncShimControl, lines


def commands(mapping: Mapping[str, str]) -> list[str]:
    """The lines that replace a rank's map with `mapping` (old device name -> new one): the map
    emptied, then one pair per line, in the order of the old names. ValueError for a bad name."""
    return [lines.devmap(None)] + [lines.devmap(old, new) for old, new in sorted(mapping.items())]


async def send(shim: AsyncShimControl, mapping: Mapping[str, str], timeout_s: float) -> None:
    """Replace the rank's map with `mapping`; ControlError if its shim refuses a line (a shim built
    before `devmap` answers "unknown command")."""
    for line in commands(mapping):
        await shim.phase(line, timeout_s)
