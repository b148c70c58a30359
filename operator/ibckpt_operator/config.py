"""The operator's settings: one object, set by main() from flags (or by tests before an in-process run)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ibckpt.agentapi import DEFAULT_PORT

FINALIZER = "ibckpt.io/finalizer"
AGENT_SELECTOR = "app.kubernetes.io/component=agent"
COMPONENT = "ibckpt-operator"


@dataclass(frozen=True)
class OperatorConfig:
    namespace: str = "ibckpt-system"  # where the operator runs: its Lease and the agent pods live here
    identity: str = ""  # this replica's name in the Lease
    lease_name: str = "ibckpt-operator"
    lease_seconds: float = 15.0
    lease_enabled: bool = True
    metrics_port: int = 9108  # 0: no metrics server
    metrics_host: str = "0.0.0.0"
    coordinator_host: str = ""  # where agents reach the coordinator: the pod's IP (POD_IP) by default
    coordinator_bind: str = "0.0.0.0"
    coordinator_port: int = 7070
    agent_selector: str = AGENT_SELECTOR
    agent_port: int = DEFAULT_PORT
    # The operator's own service account (in `namespace`): its tokens for the agents are requested for it,
    # one per node (cluster/agenttokens.py).
    operator_account: str = "ibckpt-operator"
    # The release's internal TLS (cluster/internaltls.py): the operator's CA with the coordinator's
    # certificate (only the operator reads it), the agents' serving certificate (their DaemonSet mounts
    # it), and the Deployment that owns both (deleted with it; empty: no owner).
    tls_ca_secret: str = "ibckpt-internal-tls"
    agent_tls_secret: str = "ibckpt-agent-tls"
    tls_secret_owner: str = ""
    # The agents' service account (in `namespace`): granted a storage's Secrets by name in the storage's
    # namespace before a checkpoint or restore (cluster/secretgrants.py). Empty: nothing is granted.
    agent_account: str = ""
    # The image key set's directory (ibckpt/store/signing.py): parts must verify, manifests are signed.
    # Empty (tests with fake agents): unsigned, and the real agents refuse to restore what it commits.
    image_keys: str = ""
    release: str = ""  # the Helm release: labels what the operator makes outside the chart (uninstall)
    grants_owner: str = ""  # the agents' ClusterRole: owns the storage grants, so uninstall removes them
    # The memory tier (the chart's agent.memoryTier): each node's part of a checkpoint is also kept in
    # the memory of the next node's agent (machine/memorytier.py), and restores read it there first.
    memory_tier: bool = False
    agent_timeout: float = 10.0
    # An agent pod that is not Ready is waited for this long before the pods on its node are refused.
    agent_ready_wait_seconds: float = 90.0
    # An agent runs one session at a time: a restore finding it busy with another job's waits this long.
    agent_busy_wait_seconds: float = 600.0
    poll_seconds: float = 1.0  # how often a running agent session's report is read
    # An agent busy staging images may answer late; silence this long fails the step (AgentUnreachable).
    agent_unreachable_seconds: float = 120.0
    # A Checkpoint's deletion sweeps chunks no other checkpoint references once older than this.
    gc_grace_seconds: float = 3600.0
    # Each CheckpointStorage's bucket is swept of unreferenced chunks and abandoned parts this often.
    store_sweep_seconds: float = 3600.0
    # The cheap S3 check before any pod is touched: short bounds, an unreachable endpoint fails fast.
    s3_check_timeout: float = 5.0
    s3_check_attempts: int = 2
    tick_seconds: float = 30.0  # the longest a job's loop sleeps without an event

    def with_(self, **changes: object) -> OperatorConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def default_identity() -> str:
    return os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or f"ibckpt-operator-{os.getpid()}"


_current = OperatorConfig(identity=default_identity())


def current() -> OperatorConfig:
    return _current


def configure(config: OperatorConfig) -> None:
    global _current
    _current = config
