"""What the machines ask the drivers to do, as data: every side effect a CheckpointJob's or a RestoreJob's
driver runs, and the one thing it does not run, AwaitMilestone.

The driver writes the new state to status first, then runs the actions in order. A StepAction's pods are
the pinned members; its attempt is the id the state recorded for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ibckpt.vocabulary import Milestone
from ibckpt_operator.machine.core import Action, StepAction


@dataclass(frozen=True)
class AwaitMilestone(StepAction):
    """Nothing to do but wait: the agents go on by themselves (the node's driver quiesces, drains,
    releases, dumps, uploads, rebuilds and resumes in turn) and the driver reports each pod that passed
    `milestone` (PodStepDone)."""

    milestone: Milestone = field(kw_only=True)


@dataclass(frozen=True)
class OpenSession(StepAction):
    """Create the coordinator session for these pods' agents (the sources', or the destinations')."""


@dataclass(frozen=True)
class CloseSession(Action):
    pass


# A CheckpointJob's side effects.


@dataclass(frozen=True)
class SelectPods(StepAction):
    """Resolve the selector or workload to pods (name, UID, node)."""


@dataclass(frozen=True)
class ClaimPods(StepAction):
    """Claim the pods for this job in the operator's registry (answer PodsClaimed or PodsBusy)."""


@dataclass(frozen=True)
class ReleaseClaim(Action):
    pass


@dataclass(frozen=True)
class AdmitPods(StepAction):
    """Per pod: its node has a ready agent, its containers are registered, the preflight passes."""


@dataclass(frozen=True)
class QuiesceRanks(StepAction):
    """Start the agents' checkpoint sessions: from the quiesce on, they carry every rank to the upload
    by themselves (AwaitMilestone follows them)."""


@dataclass(frozen=True)
class CommitManifest(StepAction):
    """Merge every member's uploaded part into the manifest: the one write that makes the checkpoint exist."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class CommitInMemory(StepAction):
    """commitOn Memory: merge the members' part manifests their holders keep into the manifest, signed for
    its bucket key, and hand it to every holder (no S3): the checkpoint exists on the memory tier."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class VerifyManifest(StepAction):
    """Look whether the manifest exists (answer ManifestCommitted or ManifestMissing); writes nothing."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class DiscardUpload(StepAction):
    """Delete what this attempt staged in the store (parts; never a committed manifest's chunks)."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class PublishCheckpoint(StepAction):
    """Create the Checkpoint object (if absent) for the committed manifest."""

    checkpoint_name: str = ""
    manifest_key: str = ""
    in_memory: bool = False  # committed on the memory tier: S3 follows in the background


@dataclass(frozen=True)
class KillSources(StepAction):
    """Kill the source processes, by pod UID (Stop mode, after the commit)."""


@dataclass(frozen=True)
class ResumeAll(StepAction):
    """Bring every rank back to running from wherever it is (reopen, or rebuild and resume): the abort."""


# A RestoreJob's side effects.


@dataclass(frozen=True)
class ResolveCheckpoint(StepAction):
    checkpoint_name: str = ""


@dataclass(frozen=True)
class PlacePods(StepAction):
    """Choose a destination node per pod within the constraints (answer PodsPlaced or StepFailed)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    avoid_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdmitNodes(StepAction):
    """Per pod: its destination node has a ready agent and the versions the checkpoint requires."""


@dataclass(frozen=True)
class DownloadImages(StepAction):
    """Start the agents' restore sessions before the pods exist: each downloads and stages its pods'
    images (by namespace and pod name), then waits for the pod of that name to be created and restored."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class CreatePods(StepAction):
    """Create each destination pod, its images staged on its node (answer PodCreated with its uid, or
    StepFailed)."""

    checkpoint_name: str = ""


@dataclass(frozen=True)
class CleanUpRestore(StepAction):
    """Kill and remove every restored rank: no part of the job may run alone."""
