"""Serves the shim's key-value protocol on a node-local unix socket, backed by the job coordinator.

The shim (native/src/coord.c) speaks one request per connection, in text lines:
    PUT <key> <value...>      -> OK
    GET <key> <timeout_ms>    -> VAL <value...> | NONE
The shim never talks to the network or holds a token: the node agent does, so the
coordinator's authentication stays in one place and the socket path is the same on every
node (a process restored elsewhere finds it where it was).

A rebuild PUTs two records per QP per GID and waits for each answer, so a round trip to the
coordinator per PUT adds up (hundreds per node, serialized: a rebuild took 13 s of 16 ranks'
round trips through qemu's user networking). So every PUT is answered at once and forwarded in
the background, all those queued meanwhile in one PUT_MANY request. The epoch records
(`e<N>/...`) are only read by GETs that wait for them. The `map/...` records are read without
waiting, but only by a peer's app after resume, which comes after the rebuild barrier: the
agent calls `published()` before it (NodeDriver's `flush_records`). A background PUT that fails is
logged and makes every later request fail, so the rebuild aborts instead of waiting for a
record that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from ibckpt.coordination.client import CoordinationTimedOut, CoordinatorClient, CoordinatorError

log = logging.getLogger(__name__)

LINE_LIMIT = 64 * 1024
MAX_GET_S = 600.0
BATCH = 4096  # PUTs forwarded in one coordinator request at most
IDLE_S = 10.0  # a shim connection with no request for this long is closed


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
        self._server = await asyncio.start_unix_server(
            self._serve, str(self.path), limit=LINE_LIMIT, backlog=1024
        )
        os.chmod(self.path, 0o600)

    def use(self, client: CoordinatorClient) -> None:
        """Forward through `client` from now on: the coordinator that replaces a lost one. A failure
        recorded so far was the lost one's."""
        self.client = client
        self.failed = None

    async def flush(self) -> None:
        """Wait until every background PUT has reached the coordinator (or failed)."""
        await self._puts.join()

    async def published(self) -> None:
        """Wait until every PUT so far has reached the coordinator; raise if one did not."""
        await self.flush()
        if self.failed is not None:
            raise CoordinatorError(f"a shim record was not published: {self.failed}")

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
        """Requests one per line, answered in order, until the shim closes the connection
        (a rebuild sends all its PUTs on one connection)."""
        try:
            while raw := await asyncio.wait_for(reader.readline(), IDLE_S):
                writer.write((await self.answer(raw.decode().rstrip("\n")) + "\n").encode())
                await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError) as exc:
            log.warning("shim request dropped: %r", exc)
        finally:
            writer.close()

    async def _forward(self) -> None:
        """Forward background PUTs, everything queued so far in one request (a later PUT of
        the same key wins, as it would one by one)."""
        while True:
            batch = [await self._puts.get()]
            while len(batch) < BATCH and not self._puts.empty():
                batch.append(self._puts.get_nowait())
            try:
                if self.failed is None:
                    await self.client.put_many(dict(batch))
            except (CoordinatorError, OSError) as exc:
                keys = ", ".join(key for key, _ in batch[:3]) + (", ..." if len(batch) > 3 else "")
                self.failed = f"PUT {keys} failed: {exc}"
                log.error("shim records not published: %s", self.failed)
            finally:
                for _ in batch:
                    self._puts.task_done()

    async def answer(self, line: str) -> str:
        verb, _, rest = line.partition(" ")
        if self.failed is not None:
            return f"ERR {self.failed}"
        if verb == "PUT":
            key, _, value = rest.partition(" ")
            self._puts.put_nowait((key, value.encode()))
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
