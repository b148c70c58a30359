"""The operator <-> node agent API, version 1: every request and reply body, as pydantic models.

HTTP on the node's own address (the agent pod is hostNetwork), JSON bodies, camelCase keys like the CRDs.
Every path but /healthz needs `Authorization: Bearer <token>`: the agent checks the token with a
TokenReview and accepts only the operator's service account (401 without a valid token, 403 for any
other identity). Errors come back as ErrorReply with the status code.

    GET  /healthz                      200 "ok" once the agent serves its registry (no auth)
    GET  /v1/info                      AgentInfo
    GET  /v1/containers                ContainerList
    POST /v1/sessions/checkpoint       CheckpointRequest -> 202 SessionReport (409: id in use)
    POST /v1/sessions/restore          RestoreRequest    -> 202 SessionReport
                                       (both: BUSY_STATUS while another session runs on the node)
    GET  /v1/sessions/{id}             SessionReport (404: unknown)
    POST /v1/sessions/{id}/abort       AbortRequest      -> SessionReport

The memory tier (agentapi/memory.py) adds agent <-> agent calls under /v1/memory/: a checkpointing agent
keeps a copy of its part in the memory of another node's agent (MemoryCopyTarget), and a restoring agent
reads chunks from it (MemoryCopySource) before it asks S3.

A session runs in the agent after the 202; the operator polls its report. Storage credentials never
travel here: a request names the Secret (ImageDestination.credentials) and the agent reads it itself.
The coordinator's per-session token does travel (the agent must present it to the coordinator); it is
a SecretStr, so it is left out of repr and of any dump that is not meant for the wire.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, SerializationInfo, field_serializer
from pydantic.alias_generators import to_camel

from ibckpt import formats
from ibckpt.api.checkpointjob import CompressionCodec
from ibckpt.api.storage import S3Location
from ibckpt.vocabulary import DEFAULT_BOUNDS as B
from ibckpt.vocabulary import Milestone, Mode, PhaseSeconds

API_PREFIX: Final = "/v1"
DEFAULT_PORT: Final = 9478
# A node's agent runs one session at a time: a new one is refused with this status (429 Too Many
# Requests) while another runs. The caller may ask again once it ends; 409 stays "that id is in use".
BUSY_STATUS: Final = 429
# The operator's leadership epoch on every call: an agent refuses a caller whose epoch is older than one
# it has seen, so a deposed leader that has not noticed yet cannot drive a node behind its successor's
# back (a fencing token). The epoch is "<the Lease's creation, unix seconds>:<its leaseTransitions when
# this leader took it>": compared as a pair, so a Lease made again (a reinstall) starts above the old one.
LEADER_EPOCH_HEADER: Final = "X-Ibckpt-Leader-Epoch"
# What the audiences of the operator's tokens for the agents start with (agent_audience below).
AGENT_AUDIENCE: Final = "ibckpt-agent"
LeaderEpoch = tuple[int, int]


def agent_audience(node: str) -> str:
    """The audience of a token for the agent of `node` alone. The operator requests short-lived tokens
    for it (TokenRequest) and each agent reviews tokens for its own node's audience only: a token taken
    from a call to one agent is refused by every other agent, by the apiserver and by anything else."""
    if not node or any(c.isspace() for c in node):
        raise ValueError(f"not a node name: {node!r}")
    return f"{AGENT_AUDIENCE}:{node}"


def format_epoch(epoch: LeaderEpoch) -> str:
    return f"{epoch[0]}:{epoch[1]}"


def parse_epoch(text: str) -> LeaderEpoch:
    """The pair, or ValueError for anything else (two non-negative decimal integers)."""
    created, sep, transitions = text.partition(":")
    if not sep or not created.isdigit() or not transitions.isdigit() or len(text) > 40:
        raise ValueError(f"leader epoch {text[:40]!r} is not <seconds>:<transitions>")
    return int(created), int(transitions)


# A session id becomes part of paths on the node: keep it a plain name.
SESSION_ID_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,126}[a-z0-9])?$"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
# Serialization context that lets SecretStr fields out in clear (the client's request body only).
WIRE: Final = {"wire": True}


def clear_on_the_wire(secret: SecretStr, info: SerializationInfo) -> str:
    """Only a request body built for the wire carries a secret in clear."""
    context = info.context
    return secret.get_secret_value() if isinstance(context, dict) and context.get("wire") else str(secret)


class AgentModel(BaseModel):
    """camelCase on the wire; unknown fields refused, so a typo or a newer peer fails loudly."""

    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, extra="forbid"
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json", context=WIRE)

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, exclude_none=True, context=WIRE).encode()

    @classmethod
    def from_wire(cls, data: object) -> Self:
        return cls.model_validate(data, by_alias=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Self:
        return cls.model_validate_json(raw, by_alias=True)


class SessionKind(StrEnum):
    CHECKPOINT = "Checkpoint"
    RESTORE = "Restore"


class SessionState(StrEnum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # something broke; the ranks were brought back where they could be
    REFUSED = "Refused"  # preflight said no: nothing was touched
    ABORTED = "Aborted"  # the operator (or the coordinator) aborted it

    @property
    def finished(self) -> bool:
        return self is not SessionState.RUNNING


class RankPhase(StrEnum):
    """The last step a rank is in (checkpoint and restore share the names of docs/crds.md)."""

    PENDING = "Pending"
    PREFLIGHT = "Preflight"
    PRE_DUMPING = "PreDumping"
    QUIESCING = "Quiescing"
    DRAINING = "Draining"
    RELEASING = "Releasing"
    DUMPING = "Dumping"
    UPLOADING = "Uploading"
    DOWNLOADING = "Downloading"
    RESTORING = "Restoring"
    REBUILDING = "Rebuilding"
    RESUMING = "Resuming"
    STOPPED = "Stopped"
    HELD = "Held"
    DONE = "Done"
    RESUMED = "Resumed"  # the session failed or was aborted, and this rank runs again
    FAILED = "Failed"


# -- what the agent knows ------------------------------------------------------------------------------


class RegisteredContainer(AgentModel):
    """A container the OCI hook registered on this node (the registry's entry, as the operator sees it)."""

    container_id: str
    namespace: str
    pod: str
    pod_uid: str
    container: str
    pid: int = Field(gt=0, description="Host pid of the container's first process.")
    control_socket: str = Field(description="Host path of the first process's control socket.")
    sockets: list[str] = Field(default_factory=list, description="Every control socket the shim made.")
    shim: bool = Field(description="The shim is preloaded: the container can be checkpointed.")
    shim_build: str | None = Field(
        default=None,
        description="sha256 of the shim build its processes map; None: started before builds were kept.",
    )
    reason: str = ""


class AgentFormats(AgentModel):
    """The checkpoint formats an agent writes and reads (ibckpt/formats.py): what decides whether it can
    restore a checkpoint, not its version."""

    writes: dict[str, int]
    reads: dict[str, list[int]]

    @classmethod
    def this_release(cls) -> AgentFormats:
        return cls(writes=dict(formats.WRITES), reads={k: list(v) for k, v in formats.READS.items()})


class AgentInfo(AgentModel):
    node: str
    version: str
    formats: AgentFormats | None = Field(default=None, description="None: an agent before formats.")
    ready: bool
    address: str = Field(description="host:port this API is served on.")
    shim_path: str = Field(description="The shim installed on the node (host path).")
    shim_present: bool
    shim_sha256: str | None = Field(default=None, description="sha256 of the shim file; None: absent.")
    shim_builds: list[str] = Field(
        default_factory=list,
        description="sha256 of every shim build the node keeps: a restore mounts the one its checkpoint's "
        "processes mapped. Empty: an agent before builds were kept (only shim_sha256).",
    )
    containers: list[RegisteredContainer] = Field(default_factory=list)
    sessions: list[str] = Field(default_factory=list, description="Ids of sessions still running.")
    rdma_devices: list[str] | None = Field(
        default=None,
        description="The node's RDMA devices (HCA names, in uverbs order); None: an agent before they were "
        "reported (a restore's devices are then checked by the agent only).",
    )


class ContainerList(AgentModel):
    node: str
    containers: list[RegisteredContainer]


class ErrorReply(AgentModel):
    error: str


# -- sessions --------------------------------------------------------------------------------------------


class SecretRef(AgentModel):
    """A Secret the agent reads itself: the operator grants it `get` on this name in this namespace (the
    storage's, which is the job's) just before it calls (docs/helm.md, "Storage Secrets")."""

    namespace: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    name: str = Field(min_length=1, max_length=253, pattern=NAME_PATTERN)


class ImageDestination(AgentModel):
    """Where a checkpoint's images go: this node stages its part of checkpoint `checkpointId` of `job`."""

    location: S3Location
    credentials: SecretRef = Field(description="The Secret behind location.credentialsSecretRef.")
    job: str = Field(min_length=1, max_length=253)
    checkpoint_id: str = Field(min_length=1, max_length=128)
    first_rank: int = Field(
        default=0, ge=0, description="The checkpoint's rank number of this node's first container tree."
    )
    # Sent only when it is not zstd: an agent from before this field then still takes every default job.
    compression: CompressionCodec | None = Field(
        default=None, description="The job's spec.compression when not zstd: none turns the store's zstd off."
    )

    @property
    def codec(self) -> CompressionCodec:
        return self.compression or "zstd"


class ImageSource(AgentModel):
    """A committed checkpoint to restore from."""

    location: S3Location
    credentials: SecretRef
    job: str = Field(min_length=1, max_length=253)
    checkpoint_id: str = Field(min_length=1, max_length=128)


class PhaseTimeouts(AgentModel):
    """The bound on each of this node's phases, in seconds (CheckpointJob.spec.timeouts)."""

    preflight_seconds: float = Field(default=B.preflight, gt=0)
    quiesce_seconds: float = Field(default=B.quiesce, gt=0)
    drain_seconds: float = Field(default=B.drain, gt=0)
    release_seconds: float = Field(default=B.release, gt=0)
    dump_seconds: float = Field(default=B.dump, gt=0)
    upload_seconds: float = Field(default=B.upload, gt=0)
    download_seconds: float = Field(default=B.download, gt=0)
    restore_seconds: float = Field(default=B.restore, gt=0)
    rebuild_seconds: float = Field(default=B.rebuild, gt=0)
    resume_seconds: float = Field(default=B.resume, gt=0)

    def seconds(self) -> PhaseSeconds:
        """The same bounds as the node reads them (a plain dataclass: the node needs no pydantic)."""
        return PhaseSeconds(**self.model_dump())


class RankRef(AgentModel):
    """A container of a member pod on this node; each process of it that runs under the shim is a rank."""

    pod_uid: str = Field(min_length=1, max_length=64)
    container: str = Field(min_length=1, max_length=63)
    pod: str = Field(default="", max_length=317, description="NAMESPACE/NAME of the pod, for messages.")


class SessionBase(AgentModel):
    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    coordinator: str = Field(
        pattern=r"^[^\s:]+:[0-9]{1,5}$", description="host:port of the job's coordinator."
    )
    session_token: SecretStr = Field(description="The coordinator's token for this session.")
    epoch: int = Field(default=1, ge=1)
    timeouts: PhaseTimeouts = Field(default_factory=PhaseTimeouts)

    @field_serializer("session_token")
    def _token(self, token: SecretStr, info: SerializationInfo) -> str:
        return clear_on_the_wire(token, info)


class MemoryCopyTarget(AgentModel):
    """Where a checkpointing agent keeps the memory copy of its part: another node's agent (the operator
    chooses it, never the node itself)."""

    node: str = Field(min_length=1, max_length=253)
    address: str = Field(pattern=r"^[^\s/]+:[0-9]{1,5}$", description="host:port of that node's agent API.")
    # False (not sent: an agent from before it reads the request as before): the copy follows the upload
    first: bool = Field(
        default=False,
        description="Keep the copy, with the part's signed manifest, before the S3 upload and report "
        "MemoryKept: the job commits on the memory tier (commitOn: Memory).",
    )


class MemoryCopySource(AgentModel):
    """A memory copy a restoring agent may read chunks from before it asks S3: `part` (the source node's
    part of the checkpoint) as the agent of `node` holds it."""

    node: str = Field(min_length=1, max_length=253)
    address: str = Field(pattern=r"^[^\s/]+:[0-9]{1,5}$")
    part: str = Field(min_length=1, max_length=253)


class MemoryCopyReport(AgentModel):
    """Checkpoint: the copy of this node's part that `node` keeps (`kept`: sealed there). Restore: what was
    read from memory copies instead of S3 (`node`: the holder, or several joined by commas)."""

    node: str
    part: str
    kept: bool = False
    chunks: int = Field(default=0, ge=0)
    bytes: int = Field(default=0, ge=0)
    seconds: float = Field(default=0.0, ge=0)
    message: str = ""


class StagingProgress(AgentModel):
    """A restore's download on this node so far: the operator creates the pods once every node's is about
    to end (machine/restore.py, "Overlap"), so that they start while the last bytes arrive."""

    bytes_done: int = Field(default=0, ge=0, description="Bytes of the planned files written so far.")
    bytes_planned: int = Field(default=0, ge=0, description="Bytes of every file this node stages.")
    seconds: float = Field(default=0.0, ge=0, description="Since the download began, at `bytes_done`.")


class CheckpointRequest(SessionBase):
    job: str = Field(min_length=1, max_length=253, description="The job's name in rank keys.")
    mode: Mode = Mode.LEAVE_RUNNING
    ranks: list[RankRef] = Field(min_length=1)
    images: ImageDestination | None = Field(
        default=None, description="Stage the images to S3; without it they stay on the node."
    )
    job_addresses: list[str] = Field(default_factory=list, description="Addresses of the job's nodes.")
    pre_dump: bool = Field(
        default=False,
        description="Pre-dump every tree before the cut, then pass the PreDumped barrier (spec.preDump).",
    )
    # None (not sent, so an agent from before the memory tier reads the request as before): S3 only
    memory_copy: MemoryCopyTarget | None = Field(
        default=None, description="Also keep this node's part in that agent's memory (the memory tier)."
    )


class RestoreRank(AgentModel):
    """A rank to restore here: the new pod (by namespace and name) and the rank's key in the images.

    The operator asks before it creates the pods, so that the images are staged when the runtime
    creates the containers: pod_uid is then empty and the pod of that name created afterwards is the
    one restored. A request for pods that exist already names their uid."""

    pod_uid: str = Field(default="", max_length=64)
    container: str = Field(min_length=1, max_length=63)
    rank_key: str = Field(min_length=1, description="job/pod/container/process of the checkpointed rank.")
    namespace: str = Field(default="", max_length=63, description="The new pod's namespace.")
    pod: str = Field(default="", max_length=253, description="The new pod's name.")


class RestoreRequest(SessionBase):
    job: str = Field(min_length=1, max_length=253)
    images: ImageSource
    checkpoint: str = Field(
        default="",
        max_length=317,
        description="The Checkpoint (NAMESPACE/NAME): the new pods' ibckpt.io/restore-from annotation.",
    )
    ranks: list[RestoreRank] = Field(default_factory=list)
    rejoin: list[RankRef] = Field(
        default_factory=list, description="Ranks held on this node (Hold) that rebuild with the moved ones."
    )
    remap_ip: dict[str, str] = Field(default_factory=dict, description="Old address -> new address.")
    # None (not sent: an agent from before it reads the request as before): no explicit map
    device_map: dict[str, str] | None = Field(
        default=None,
        description="Old RDMA device name -> new one, ahead of the rule in ibckpt/devicemap.py.",
    )
    memory_copies: list[MemoryCopySource] | None = Field(
        default=None, description="Living memory copies of the checkpoint's parts, read before S3."
    )
    memory_only: bool = Field(
        default=False,
        description="The checkpoint is held in memory only: its signed manifest and every chunk come from "
        "memory_copies' holders, and S3 is never asked.",
    )


class AbortRequest(AgentModel):
    reason: str = Field(min_length=1, max_length=1024)
    # After an operator restart the session's coordinator is gone with it: the next operator opens one
    # for the recovery, and ranks left released rebuild with their peers through it.
    coordinator: str | None = Field(
        default=None,
        pattern=r"^[^\s:]+:[0-9]{1,5}$",
        description="host:port of the coordinator that replaces the session's lost one.",
    )
    session_token: SecretStr | None = Field(default=None, description="Its token for this session.")

    @field_serializer("session_token")
    def _token(self, token: SecretStr | None, info: SerializationInfo) -> str | None:
        return None if token is None else clear_on_the_wire(token, info)


class RankProgress(AgentModel):
    rank_key: str
    pod_uid: str
    container: str
    pid: int | None = None
    phase: RankPhase = RankPhase.PENDING
    done: Milestone | None = Field(default=None, description="The last milestone the rank passed.")
    bytes: int = Field(default=0, ge=0, description="Image bytes written (checkpoint) or read (restore).")
    seconds: float = Field(default=0.0, ge=0)
    error: str = ""


class SessionReport(AgentModel):
    session_id: str
    kind: SessionKind
    node: str
    state: SessionState = SessionState.RUNNING
    phase: str = Field(default="", description="The node's current (or last) phase.")
    ranks: list[RankProgress] = Field(default_factory=list)
    phases: dict[str, float] = Field(default_factory=dict, description="Seconds per finished phase.")
    message: str = ""
    bytes: int = Field(default=0, ge=0)
    started_at: float = Field(description="Unix time.")
    finished_at: float | None = None
    memory_copy: MemoryCopyReport | None = Field(default=None, description="The memory tier's part here.")
    staging: StagingProgress | None = Field(default=None, description="A restore's download, once planned.")
