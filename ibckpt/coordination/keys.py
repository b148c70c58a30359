"""The shapes of the keys participants write in a session's key-value store, and what each one claims.

Written once for the node agent (preflight, the shims' proxy) and the coordinator, which keeps each
participant to the keys it claimed first (operator/ibckpt_operator/coordinator/session.py).
"""

from __future__ import annotations

import re

from ibckpt.vocabulary import Milestone

ZERO_GID = "0" * 32
# What a shim publishes and reads (native/src/records.c): map/GID/QPN and eN/qp/GID/QPN.
SHIM_RECORD = re.compile(r"(?:map|e[0-9]{1,20}/qp)/([0-9a-f]{32})/([0-9]{1,10})")
# The epoch records among them (a rebuild's new QP), as against the `map/` ones.
EPOCH_RECORD = re.compile(r"e[0-9]{1,20}/qp/")
# What preflight publishes for each (GID, QPN) a node's ranks hold.
PREFLIGHT_QP = re.compile(r"preflight/qp/([0-9a-f]{32})/([0-9]{1,10})")

# Written by the coordinator the moment every node has reached the Drained barrier, before any node
# hears so and releases: from then on an abort releases every rank and rebuilds them all, since a peer
# may have released (abort.py). A node whose own barrier call failed reads it to know.
RELEASING = "cut/releasing"
# The key the coordinator writes as each of these barriers passes.
PASSED_BARRIER_KEYS = {Milestone.DRAINED.value: RELEASING}

# A claim: ("qp", GID, QPN) for every key naming a QP, else ("key", the key).
Claim = tuple[str, ...]


def qp_key(gid_hex: str, qpn: int) -> str:
    """The key under which a node publishes that one of its ranks holds (GID, QPN)."""
    return f"preflight/qp/{gid_hex}/{qpn}"


def gid_key(gid_hex: str) -> str:
    """The key under which a node publishes that one of its ranks holds a GID (for UD)."""
    return f"preflight/gid/{gid_hex}"


def claim_of(key: str) -> Claim | None:
    """What writing `key` claims. One QP's keys (preflight's, `map/`, every epoch's record) make one
    claim: the rank that holds the QP is on one node in a session, so they are one participant's.
    None: the key names GID 0, which nobody can be reached at, and two ranks of a job may both publish
    such a key (an unset GID table entry, QP numbers that repeat across nodes)."""
    found = SHIM_RECORD.fullmatch(key) or PREFLIGHT_QP.fullmatch(key)
    if found is None:
        return ("key", key)
    gid, qpn = found.groups()
    if gid == ZERO_GID:
        return None
    return ("qp", gid, str(int(qpn)))
