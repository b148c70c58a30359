"""A job coordinator on 127.0.0.1, run in its own thread for tests driven from the host."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.coordinator import ThreadedCoordinator


@pytest.fixture
def coordinator() -> Iterator[ThreadedCoordinator]:
    coord = ThreadedCoordinator()
    coord.start()
    try:
        yield coord
    finally:
        coord.stop()
