"""The node side of container start: `ibckpt-runc` (runtime handler) and `ibckpt-hook` (OCI hook).

Both run on every container create, so this package imports only the standard library's cheapest
modules (json, os, socket, time): no pydantic, asyncio or the rest of ibckpt_node.
"""
