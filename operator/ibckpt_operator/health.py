"""The operator's health endpoints, served from its first second (kopf's own liveness endpoint starts only
after the startup handlers, so a standby waiting for the Lease in one would never answer its probes):

- `/healthz` (liveness): 200 unless this replica lost the Lease (it then exits and restarts as a standby);
- `/readyz` (readiness): 200 for the leader, and for a standby whose apiserver answers (it can take over).

The body says which: "leader", or who holds the Lease.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ibckpt_operator.drivers import runtime

log = logging.getLogger(__name__)


async def _healthz(_request: web.Request) -> web.Response:
    state = runtime.standing()
    return web.Response(status=200 if state.alive else 500, text=state.message + "\n")


async def _readyz(_request: web.Request) -> web.Response:
    state = runtime.standing()
    return web.Response(status=200 if state.ready else 503, text=state.message + "\n")


async def serve(host: str, port: int) -> web.AppRunner:
    """Start serving; the caller cleans the returned runner up."""
    app = web.Application()
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("health endpoints on %s:%d (/healthz, /readyz)", host, port)
    return runner
