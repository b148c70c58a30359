"""What every API type shares: camelCase on the wire, snake_case in Python, and the CRD facts of a kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "ibckpt.io"
VERSION = "v1alpha1"
API_VERSION: Final = "ibckpt.io/v1alpha1"  # GROUP/VERSION, spelled out for the type checker
CATEGORY = "ibckpt"


class ApiModel(BaseModel):
    """Base of every spec and status type.

    Unknown fields are ignored when reading, as the apiserver prunes them too: an older operator reading an
    object written for a newer schema must not fail.
    """

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object Kubernetes stores: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @classmethod
    def from_wire(cls, data: object) -> Self:
        return cls.model_validate(data, by_alias=True)


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"] = "string"
    description: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class KindInfo:
    """The CRD facts of one kind, beside its spec and status models."""

    kind: str
    plural: str
    short_names: tuple[str, ...]
    scope: Literal["Namespaced", "Cluster"]
    summary: str
    spec: type[ApiModel]
    status: type[ApiModel]
    printer_columns: tuple[PrinterColumn, ...] = field(default_factory=tuple)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"
