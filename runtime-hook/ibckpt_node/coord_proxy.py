"""Serves the shim's key-value protocol on a node-local unix socket, backed by the job coordinator.

The shim (native/src/coord.c) speaks one request per connection, in text lines:
    PUT <key> <value...>      -> OK
    GET <key> <timeout_ms>    -> VAL <value...> | NONE
The shim never talks to the network or holds a token: the node agent does, so the
coordinator's authentication stays in one place and the socket path is the same on every
node (a process restored elsewhere finds it where it was).

A rebuild PUTs two records per QP and waits for each answer, so a round trip to the coordinator
per PUT adds up (hundreds per node). The epoch records (`e<N>/...`) are only ever read by GETs
that wait for them, so those PUTs are answered at once and forwarded in the background, in
order; other keys (`map/...`, which peers read without waiting) are forwarded before `OK`. A
background PUT that fails is logged and makes every later request fail, so the rebuild aborts
instead of waiting for a record that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from pathlib import Path

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient, CoordinatorError

log = logging.getLogger(__name__)

LINE_LIMIT = 64 * 1024
MAX_GET_S = 600.0
# Keys only read by waiting GETs: their PUTs may be answered before they reach the coordinator.
WRITE_BEHIND = re.compile(r"e\d+/")


class ShimCoordinatorProxy:
    def __init__(self, path: Path, client: CoordinatorClient) -> None:
        self.path = path
        self.client = client
        self._server: asyncio.AbstractServer | None = None
        self._puts: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._forwarder: asyncio.Task[None] | None = None
        self.failed: str | None = None  # the first background PUT that failed, and why

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._forwarder = asyncio.ensure_future(self._forward())
        self._server = await asyncio.start_unix_server(self._serve, str(self.path), limit=LINE_LIMIT)
        os.chmod(self.path, 0o600)

    async def flush(self) -> None:
        """Wait until every background PUT has reached the coordinator (or failed)."""
        await self._puts.join()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._forwarder is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), 30)
            self._forwarder.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def __aenter__(self) -> ShimCoordinatorProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), 10)).decode().rstrip("\n")
            writer.write((await self.answer(line) + "\n").encode())
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError) as exc:
            log.warning("shim request dropped: %r", exc)
        finally:
            writer.close()

    async def _forward(self) -> None:
        """Forward background PUTs one at a time, in the order the shims sent them."""
        while True:
            key, value = await self._puts.get()
            try:
                if self.failed is None:
                    await self.client.put(key, value)
            except (CoordinatorError, OSError) as exc:
                self.failed = f"PUT {key} failed: {exc}"
                log.error("shim record not published: %s", self.failed)
            finally:
                self._puts.task_done()

    async def answer(self, line: str) -> str:
        verb, _, rest = line.partition(" ")
        if self.failed is not None:
            return f"ERR {self.failed}"
        if verb == "PUT":
            key, _, value = rest.partition(" ")
            if WRITE_BEHIND.match(key):
                self._puts.put_nowait((key, value.encode()))
            else:
                await self.flush()  # keep the order of all PUTs
                await self.client.put(key, value.encode())
            return "OK"
        if verb == "GET":
            key, _, timeout_ms = rest.partition(" ")
            timeout = min(max(int(timeout_ms or "0"), 0) / 1000.0, MAX_GET_S)
            try:
                found = await self.client.get(key, timeout)
            except CoordinationTimedOut:
                return "NONE"
            except CoordinatorError as exc:
                # Aborted or lost: the shim's rebuild fails and the agent's abort path takes over.
                log.warning("GET %s failed: %s", key, exc)
                return "NONE"
            return f"VAL {found.decode()}"
        return "ERR unknown verb"
