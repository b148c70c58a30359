"""The memory tier's routes on the agent API (ibckpt/agentapi/memory.py), over this agent's shelf
(memorytier.py). The caller was authenticated before (server.py)."""

from __future__ import annotations

import json

from pydantic import ValidationError

from ibckpt.agentapi.memory import (
    CHUNK_ID,
    COPIES,
    MANIFESTS,
    PIECE_BYTES,
    MemorySeal,
    parse_copy_path,
    parse_manifest_path,
)
from ibckpt_node.agent.httpserver import Response
from ibckpt_node.agent.memorytier import MemoryShelf, ShelfError

ROUTE = f"{COPIES}/{{copy}}"  # the metrics' labels: never a raw path
MANIFEST_ROUTE = f"{MANIFESTS}/{{checkpoint}}"


def _error(status: int, message: str) -> Response:
    return Response(status, json.dumps({"error": message}).encode())


def _ok(body: bytes | memoryview, content_type: str = "application/json") -> Response:
    return Response(200, body, content_type)


def handle(shelf: MemoryShelf, method: str, path: str, body: bytes) -> Response:
    if path == COPIES and method == "GET":
        return _ok(shelf.listing().to_json())
    if path.startswith(MANIFESTS + "/"):
        return _manifest(shelf, method, path, body)
    parsed = parse_copy_path(path)
    if parsed is None:
        return _error(404, f"no such path {path}")
    job, checkpoint, part, verb, argument = parsed
    try:
        if part is None and verb is None and method == "DELETE":
            shelf.drop(job, checkpoint)
            return _ok(shelf.listing().to_json())
        if part is None:
            return _error(405, f"{method} {path} is not part of the memory tier's API")
        key = (job, checkpoint, part)
        if verb == "pieces" and method == "PUT" and argument is not None and argument.isdigit():
            shelf.put_piece(key, int(argument), body)
            return Response(204)
        if verb == "seal" and method == "POST":
            return _ok(shelf.seal(key, MemorySeal.from_json(body)).to_json())
        if verb == "chunks" and method == "GET" and argument is not None and CHUNK_ID.match(argument):
            stored = shelf.chunk(key, argument)
            if stored is None:
                return _error(404, f"chunk {argument} of {job}/{checkpoint} part {part} is not held here")
            return _ok(stored, "application/octet-stream")
        if verb == "manifest" and method == "GET":
            manifest = shelf.part_manifest(key)
            if manifest is None:
                return _error(404, f"no sealed copy of {job}/{checkpoint} part {part} with a manifest here")
            return _ok(manifest)
    except ShelfError as error:
        return _error(error.status, str(error))
    except ValidationError as error:
        return _error(422, f"bad request body: {error}")
    return _error(405, f"{method} {path} is not part of the memory tier's API")


def _manifest(shelf: MemoryShelf, method: str, path: str, body: bytes) -> Response:
    """A checkpoint's signed manifest, kept beside its copies."""
    parsed = parse_manifest_path(path)
    if parsed is None:
        return _error(404, f"no such path {path}")
    job, checkpoint = parsed
    if method == "GET":
        manifest = shelf.manifest(job, checkpoint)
        if manifest is None:
            return _error(404, f"no manifest of {job}/{checkpoint} held here")
        return _ok(manifest)
    if method == "PUT":
        if len(body) > PIECE_BYTES:  # the server's own bound is the same; this says so for any server
            return _error(413, f"a manifest of at most {PIECE_BYTES} bytes, not {len(body)}")
        try:
            shelf.put_manifest(job, checkpoint, body)
        except ShelfError as error:
            return _error(error.status, str(error))
        return Response(204)
    return _error(405, f"{method} {path} is not part of the memory tier's API")
