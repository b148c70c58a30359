"""Predicates on an object's status, for the tests' waits (`Cluster.wait(kind, name, predicate)`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def phase(wanted: str) -> Callable[[dict[str, Any]], bool]:
    """True once the object's status.phase is `wanted`."""
    return lambda body: (body.get("status") or {}).get("phase") == wanted
