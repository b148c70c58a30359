"""The memory tier's wire (docs/recovery.md, "Tiers"): agent <-> agent calls under /v1/memory/, the one
definition of their paths and bodies, and the client both sides use.

    PUT    /v1/memory/copies/{job}/{checkpoint}/{part}/pieces/{n}   raw bytes, at most PIECE_BYTES; n from 0,
                                                                  in order (409 otherwise; 0 starts over)
    POST   /v1/memory/copies/{job}/{checkpoint}/{part}/seal         MemorySeal -> HeldCopy
    GET    /v1/memory/copies/{job}/{checkpoint}/{part}/chunks/{id}  a chunk's stored bytes (404: not held)
    GET    /v1/memory/copies/{job}/{checkpoint}/{part}/manifest     the part's signed part manifest, as its
                                                                  seal carried it (404: none, or not sealed)
    GET    /v1/memory/copies                                        HeldCopies
    DELETE /v1/memory/copies/{job}/{checkpoint}                     HeldCopies (what is left); the
                                                                  checkpoint's manifest goes with its copies
    PUT    /v1/memory/manifests/{job}/{checkpoint}                  raw bytes, at most PIECE_BYTES: the
                                                                  checkpoint's signed manifest (404: no copy
                                                                  of it held here)
    GET    /v1/memory/manifests/{job}/{checkpoint}                  those bytes (404: none)

Segments are URL-quoted (a job is `namespace/name`). A copy is the chunks of one node's part (`part`: that
node) as the store keeps them, appended piece by piece, then sealed with its index; only sealed copies
are served. A copy made before the upload (MemoryCopyTarget.first) carries its part's signed manifest in
its seal, and the operator, once it merged the parts, writes the checkpoint's signed manifest to each
holder: the checkpoint then commits, and restores, from memory alone. A manifest counts in the budget and
lives as long as some copy of its checkpoint does. 507: the holder's budget cannot take it (the copy is
dropped). Callers: the agents, with their own service account's token of MEMORY_TIER_AUDIENCE, and the
operator with its per-node token.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import quote, unquote

from pydantic import Field

from ibckpt.agentapi.client import AgentClient, AgentError
from ibckpt.agentapi.models import API_PREFIX, AgentModel

MEMORY_TIER_AUDIENCE: Final = "ibckpt-memory-tier"
MEMORY: Final = f"{API_PREFIX}/memory"
COPIES: Final = f"{MEMORY}/copies"
MANIFESTS: Final = f"{MEMORY}/manifests"
PIECE_BYTES: Final = 1024 * 1024  # the agent's largest request body (agent/httpserver.py MAX_BODY)
FULL_STATUS: Final = 507  # Insufficient Storage: over the holder's budget
CHUNK_ID: Final = re.compile(r"^[0-9a-f]{64}$")
_PATH = re.compile(
    rf"^{re.escape(COPIES)}/([^/]+)/([^/]+)(?:/([^/]+)(?:/(pieces|seal|chunks|manifest)(?:/([^/]+))?)?)?$"
)
_MANIFEST_PATH = re.compile(rf"^{re.escape(MANIFESTS)}/([^/]+)/([^/]+)$")


class MemorySeal(AgentModel):
    """The end of a copy: where each chunk lies in the bytes sent, and how many bytes that was."""

    chunks: dict[str, tuple[int, int]] = Field(description="chunk id -> (offset, length) in the copy.")
    bytes: int = Field(ge=0)
    manifest: str | None = Field(
        default=None, description="The part's signed part manifest (JSON), kept with the copy."
    )


class HeldCopy(AgentModel):
    job: str
    checkpoint: str
    part: str
    bytes: int
    chunks: int
    sealed: bool
    created_at: float = Field(description="Unix time of its first piece.")


class HeldCopies(AgentModel):
    node: str
    budget: int = Field(description="Bytes this agent may hold for the others (0: the tier is off here).")
    used: int
    copies: list[HeldCopy] = Field(default_factory=list)


def copy_path(job: str, checkpoint: str, part: str | None = None) -> str:
    segments = [job, checkpoint] + ([part] if part is not None else [])
    return COPIES + "".join("/" + quote(s, safe="") for s in segments)


def parse_copy_path(path: str) -> tuple[str, str, str | None, str | None, str | None] | None:
    """(job, checkpoint, part, verb, argument) of a copy's path, unquoted; None for any other path."""
    match = _PATH.match(path)
    if match is None:
        return None
    job, checkpoint, part, verb, argument = match.groups()
    if (verb in ("pieces", "chunks")) != (argument is not None):
        return None
    return (
        unquote(job),
        unquote(checkpoint),
        None if part is None else unquote(part),
        verb,
        None if argument is None else unquote(argument),
    )


def manifest_path(job: str, checkpoint: str) -> str:
    return MANIFESTS + "".join("/" + quote(s, safe="") for s in (job, checkpoint))


def parse_manifest_path(path: str) -> tuple[str, str] | None:
    """(job, checkpoint) of a checkpoint manifest's path, unquoted; None for any other path."""
    match = _MANIFEST_PATH.match(path)
    if match is None:
        return None
    return unquote(match.group(1)), unquote(match.group(2))


class MemoryClient(AgentClient):
    """An agent's memory-tier calls (synchronous, each bounded by timeout_s)."""

    def put_piece(self, job: str, checkpoint: str, part: str, index: int, data: bytes) -> None:
        path = f"{copy_path(job, checkpoint, part)}/pieces/{index}"
        self._call("PUT", path, data, content_type="application/octet-stream")

    def seal(self, job: str, checkpoint: str, part: str, seal: MemorySeal) -> HeldCopy:
        return self._post(f"{copy_path(job, checkpoint, part)}/seal", seal, HeldCopy)

    def chunk(self, job: str, checkpoint: str, part: str, chunk_id: str) -> bytes | None:
        """The chunk's stored bytes, or None when the holder does not have it."""
        return self._bytes_or_none(f"{copy_path(job, checkpoint, part)}/chunks/{chunk_id}")

    def part_manifest(self, job: str, checkpoint: str, part: str) -> bytes | None:
        """The signed part manifest a sealed copy carries, or None when the holder has none."""
        return self._bytes_or_none(f"{copy_path(job, checkpoint, part)}/manifest")

    def put_manifest(self, job: str, checkpoint: str, data: bytes) -> None:
        """Keep the checkpoint's signed manifest with its copies on this holder."""
        self._call("PUT", manifest_path(job, checkpoint), data, content_type="application/json")

    def manifest(self, job: str, checkpoint: str) -> bytes | None:
        """The checkpoint's signed manifest as the holder keeps it, or None when it has none."""
        return self._bytes_or_none(manifest_path(job, checkpoint))

    def _bytes_or_none(self, path: str) -> bytes | None:
        try:
            _, data = self._call("GET", path, None)
        except AgentError as error:
            if error.status == 404:
                return None
            raise
        return data

    def copies(self) -> HeldCopies:
        return self._get(COPIES, HeldCopies)

    def drop(self, job: str, checkpoint: str) -> HeldCopies:
        _, data = self._call("DELETE", copy_path(job, checkpoint), None)
        return self._parse(COPIES, data, HeldCopies)
