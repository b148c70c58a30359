"""The real coordinator server on its loopback socket, for the tests of this folder."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.tlsfiles import shared_pki


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer(shared_pki().coordinator())
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()
