"""A job coordinator on 127.0.0.1 in its own thread, for tests and the demo driven from the host: TLS with
the test process's CA (testbed.tlsfiles.shared_pki; its clients trust shared_pki().client())."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

from ibckpt_operator.coordinator.server import CoordinatorServer
from testbed.tlsfiles import shared_pki


class ThreadedCoordinator:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = CoordinatorServer(shared_pki().coordinator())
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def port(self) -> int:
        return self.server.port

    def create_session(
        self, participants: set[str], deadline_s: float = 600, session_id: str | None = None
    ) -> tuple[str, dict[str, str]]:
        """(session id, each participant's credential)."""

        async def create() -> tuple[str, dict[str, str]]:
            return self.server.create_session(participants, deadline_s, session_id)

        return asyncio.run_coroutine_threadsafe(create(), self.loop).result(10)


def guest_envs(sessions: Mapping[str, Mapping[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of guests 1 and 2 (run_pair): each variable holds that guest's own credential
    for the session (its agent is participant node-N), never the other node's."""
    env_1, env_2 = (
        {var: tokens[f"node-{n}"] for var, tokens in sessions.items() if f"node-{n}" in tokens}
        for n in (1, 2)
    )
    return env_1, env_2
