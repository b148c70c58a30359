"""What the drain wiring reads from the cluster, without a cluster: which nodes are draining, how a
migration's CheckpointJob and RestoreJob phases become machine events, and the DrainState through status
and back (what a restarted operator reads)."""

from __future__ import annotations

import pytest

from ibckpt.api import CheckpointScheduleStatus
from ibckpt.api.schedule import OnDrainFailure
from ibckpt_operator.cluster import drains
from ibckpt_operator.machine.core import PodRef
from ibckpt_operator.machine.drain import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStarted,
    DrainConfig,
    DrainMachine,
    NodeDraining,
    RestoreFailed,
    RestoreSucceeded,
    SourcesStopped,
)


@pytest.mark.parametrize(
    ("spec", "draining"),
    [
        ({}, False),
        ({"unschedulable": True}, True),
        ({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}, True),
        ({"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}, True),
        ({"taints": [{"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"}]}, False),
        ({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "PreferNoSchedule"}]}, False),
        ({"taints": [{"key": "gpu", "effect": "NoSchedule"}]}, False),
    ],
)
def test_which_nodes_are_draining(spec: dict[str, object], draining: bool) -> None:
    assert drains.node_draining({"spec": spec}) is draining


def job(phase: str, **status: object) -> dict[str, object]:
    return {"status": {"phase": phase, **status}}


def test_checkpoint_job_phases_become_events() -> None:
    name = "ring-drain-1"
    assert drains.checkpoint_job_events(name, None) == []
    assert drains.checkpoint_job_events(name, job("Pending")) == []
    assert drains.checkpoint_job_events(name, job("Quiescing")) == [CheckpointStarted(name)]
    committed = [CheckpointStarted(name), CheckpointCommitted(name, name)]
    assert (
        drains.checkpoint_job_events(name, job("Stopped", checkpointName=name, manifestKey="k")) == committed
    )
    done = drains.checkpoint_job_events(name, job("Succeeded", checkpointName=name, manifestKey="k"))
    assert done == [*committed, SourcesStopped(name)]
    failed = drains.checkpoint_job_events(name, job("Failed", reason="PreflightRefused", message="no"))
    assert failed == [CheckpointFailed(name, "PreflightRefused", "no")]
    # A Stop job that failed after its commit (its kill failed) is not a failed checkpoint.
    late = drains.checkpoint_job_events(name, job("Failed", reason="KillFailed", manifestKey="k"))
    assert late == [CheckpointStarted(name)]


def test_restore_job_phases_become_events() -> None:
    assert drains.restore_job_events("r", job("Restoring")) == []
    assert drains.restore_job_events("r", job("Succeeded")) == [RestoreSucceeded("r")]
    failed = drains.restore_job_events("r", job("Failed", reason="NoNodeAvailable", message="none"))
    assert failed == [RestoreFailed("r", "RestoreJob r: NoNodeAvailable: none")]


def test_the_drain_state_survives_status() -> None:
    machine = DrainMachine(DrainConfig(on_failure=OnDrainFailure.KEEP_HOLDING))
    pods = (PodRef("ring-0", "u0", "node-a"), PodRef("ring-1", "u1", "node-b"))
    state = machine.handle(machine.start("ring").state, NodeDraining("node-a", pods), 1_700_000_000.5).state
    controllers = {"u1": "job-uid"}  # ring-1's Job: no new pod of it while the migration runs
    wire = CheckpointScheduleStatus(**drains.drain_status(state, controllers)).to_wire()
    assert wire["drainPhase"] == "Holding" and wire["migration"]["checkpointJob"] == "ring-drain-1"
    assert wire["migration"]["sources"][1]["controllerUid"] == "job-uid"
    back = CheckpointScheduleStatus.from_wire(wire)
    assert drains.drain_state("ring", back) == state
    assert drains.source_controllers(back) == controllers  # a restarted operator refuses them too
    assert drains.drain_state("ring", CheckpointScheduleStatus()) is None
