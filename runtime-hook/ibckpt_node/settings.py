"""A node driver's own knobs (NodeSettings) and how its cut runs (CutOptions); the per-phase bounds come
with each request (PhaseTimeouts.seconds())."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ibckpt_node.predumps import PreDumpRounds


@dataclass(frozen=True)
class NodeSettings:
    """This node's own knobs; the per-phase bounds come with the request (`PhaseTimeouts.seconds()`)."""

    # How long the shim polls for in-flight sends to complete. A send can stay pending
    # (its receiver is quiesced too and posts no receives); the peers' counters settle it
    # at rebuild, so the drain only needs to catch what completes promptly.
    drain_settle_s: float = 3.0
    # No completion for this long, with only sends the rebuild can settle left, ends the drain.
    drain_stall_ms: int = 20
    barrier_slack_s: float = 30.0  # how long a node waits for the slowest other node
    # Preflight asks whether a key was published once every node has published its own (after
    # a barrier): a key that is not there by then never comes, so the wait can be short.
    preflight_lookup_s: float = 1.0
    # The shim's lease (docs/native-shim.md, "Lease"): while the agent holds a rank out of
    # running it renews it this often, for this long; a rank whose agent died resumes on its
    # own (or, released, says it waits). Renewals go on through a dump of any length.
    lease_s: float = 30.0
    lease_renew_s: float = 5.0
    # How long an abort looks for keys.RELEASING when this node does not know whether every node drained
    # (its own barrier failed, or another agent ran the cut): the coordinator wrote it as the barrier passed.
    releasing_lookup_s: float = 3.0
    # What a checkpoint's images must leave free on the node's disk (the agent's --disk-reserve-bytes):
    # the kubelet evicts pods below its own threshold, so the images may not take the last of it.
    disk_reserve_bytes: int = 0
    # How many of the node's containers CRIU dumps at once (each CRIU is one process walking its own
    # tree): one per CPU. In turn, a LeaveRunning checkpoint kept every container released until the
    # node's last dump ended.
    parallel_dumps: int = field(default_factory=lambda: os.cpu_count() or 1)
    # Pre-dumps (the request's pre_dump): each tree is pre-dumped before the cut (phase PreDumped, with
    # its barrier) and its dump copies only what changed since, so the ranks stay gated for the last
    # dirty pages only (docs/node-agent.md, "Pre-dumps"). They need CRIU's plugin dir with
    # ibckpt_uverbs.so, as the dumps see it (for a container, on the node); without one the phase
    # passes its barrier with no pre-dump, and the trees are dumped in full. Rounds: predumps.py.
    pre_dump: bool = False
    criu_plugins: str = ""
    pre_dump_rounds: PreDumpRounds = field(default_factory=PreDumpRounds)


@dataclass(frozen=True)
class CutOptions:
    """How the cut (quiesce, drain, release) runs. The defaults are the fast cut; the others
    reproduce the cut as it was before, so a benchmark can measure both side by side."""

    # A barrier after quiesce. Not needed: a rank that drains while a peer is still running
    # sees that peer's sends complete or stall, and rebuild settles the stalled ones either way.
    # The barrier that matters comes after drain: no QP may go to ERR while a peer still waits
    # on it.
    quiesce_barrier: bool = False
    # Release waits for its CQs to stay quiet for 20 ms instead of counting flushes.
    release_quiet: bool = False


__all__ = ["CutOptions", "NodeSettings"]
