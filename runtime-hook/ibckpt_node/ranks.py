"""This node's ranks as the driver sees them: a process under the shim, reached through its control
socket, and the report of what the driver did to them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ibckpt.coordination.ranks import RankId
from ibckpt_native.control import AsyncShimControl
from ibckpt_node.procfs import process_gone

T = TypeVar("T")
SHIM_CLOSES_S = 0.2  # after a renewal's reply, time for the shim's control thread to close its end


@dataclass
class LocalRank:
    """A process on this node that runs under the shim."""

    rank: RankId
    pid: int
    control_path: Path

    @property
    def shim(self) -> AsyncShimControl:
        """The rank's control socket, one fresh connection per command; its replies are checked
        (ibckpt_native.control: the shim runs in the tenant's process)."""
        return AsyncShimControl(str(self.control_path))


@dataclass
class NodeReport:
    node: str
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, barrier included
    local: dict[str, float] = field(default_factory=dict)  # seconds until this node's part was done
    shim: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # phase -> rank -> report
    images: dict[str, Path] = field(default_factory=dict)
    restored_pids: dict[str, int] = field(default_factory=dict)
    remapped: dict[str, list[str]] = field(default_factory=dict)  # rank -> socket addresses rewritten
    locked: list[str] = field(default_factory=list)  # TCP connections held until every node restored
    boosted: dict[str, int] = field(default_factory=dict)  # phases -> threads run at a raised priority
    outcome: str = ""


async def on_all(ranks: Sequence[LocalRank], call: Callable[[LocalRank], Awaitable[T]]) -> list[T]:
    """Run a control call on every local rank at once.

    All must be in flight together: a rank's rebuild blocks until its peers on this node
    have published their records.
    """
    return list(await asyncio.gather(*(call(r) for r in ranks)))


async def unanswered(r: LocalRank, exc: BaseException, settle_s: float = 0.5) -> str:
    """Why a rank's shim did not answer; a dead process says so (the application lost a rank). A killed
    process resets its control connection while it exits, a moment before it is a zombie: that moment
    is waited for."""
    deadline = time.monotonic() + settle_s
    while not process_gone(r.pid):
        if time.monotonic() > deadline:
            return str(exc)
        await asyncio.sleep(0.05)
    return f"its process is gone ({exc})"
