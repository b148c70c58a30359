"""A job coordinator on 127.0.0.1 in its own thread, for tests and the demo driven from the host."""

from __future__ import annotations

import asyncio
import threading

from ibckpt_operator.coordinator.server import CoordinatorServer


class ThreadedCoordinator:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = CoordinatorServer()
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
    ) -> tuple[str, str]:
        async def create() -> tuple[str, str]:
            return self.server.create_session(participants, deadline_s, session_id)

        return asyncio.run_coroutine_threadsafe(create(), self.loop).result(10)
