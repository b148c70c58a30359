"""Types that several kinds use: references, label selectors, conditions."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field
from pydantic.config import JsonDict

from ibckpt.api.base import ApiModel

# Kubernetes object names (RFC 1123 subdomain); checked on the server so a typo fails at apply time.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class LocalObjectReference(ApiModel):
    """Names an object in the same namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=NAME_PATTERN)


class SecretKeyReference(ApiModel):
    """One key of a Secret in the same namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=NAME_PATTERN)
    key: str | None = Field(default=None, min_length=1, description="The key in the Secret's data.")


class LabelSelectorRequirement(ApiModel):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class LabelSelector(ApiModel):
    """A Kubernetes label selector: every rule must match. An empty selector would match every pod, so at
    least one rule is required."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None

    def is_empty(self) -> bool:
        return not self.match_labels and not self.match_expressions


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    """Ready: the object did what it was for. Progressing: work is under way. Failed: it ended without
    doing it (the reason says why)."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    FAILED = "Failed"


class Condition(ApiModel):
    """The Kubernetes condition convention (metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316)
    status: ConditionStatus
    reason: str | None = Field(default=None, max_length=1024)
    message: str | None = Field(default=None, max_length=32768)
    observed_generation: int | None = Field(default=None, ge=0)
    last_transition_time: datetime | None = None


class PhaseTiming(ApiModel):
    """One phase a job has left, as the operator saw it: when it began and how many seconds it lasted."""

    phase: str = Field(min_length=1)
    started_at: datetime
    seconds: float = Field(ge=0)


PHASE_TIMINGS_DESCRIPTION = (
    "The phases the job has left, in order: when each began and the seconds it lasted, by the operator's "
    "clock (the phase it is in began at phaseStartTime)."
)

# Conditions are a map keyed by type, so server-side apply merges them per type.
CONDITIONS_SCHEMA_EXTRA: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}

# The two fields every kind's status has, written `observed_generation: ObservedGeneration = None`.
ObservedGeneration = Annotated[int | None, Field(ge=0)]
Conditions = Annotated[list[Condition] | None, Field(json_schema_extra=CONDITIONS_SCHEMA_EXTRA)]


class StorageTier(StrEnum):
    """Where a checkpoint's images are held: S3 (durable), and a node agent's memory (the memory tier:
    fast to read, gone with that node or the job's next checkpoint)."""

    S3 = "S3"
    MEMORY = "Memory"
