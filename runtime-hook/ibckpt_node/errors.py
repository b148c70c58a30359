"""How this node's part of a session fails: the driver raises these, the agent and ibckpt-node report
them."""

from __future__ import annotations


class CheckpointFailed(RuntimeError):
    """This node's part failed or the session was aborted; the ranks were brought back if possible."""


class CheckpointRefused(CheckpointFailed):
    """Preflight found state that cannot be saved; no rank was touched."""
