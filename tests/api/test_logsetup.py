"""Debug logging of ours never turns on the HTTP libraries' debug lines, which carry credentials."""

from __future__ import annotations

import logging

from ibckpt import logsetup


def test_debug_leaves_the_http_libraries_at_warning() -> None:
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        logsetup.configure("debug")
        assert logging.getLogger("ibckpt_node.agent").isEnabledFor(logging.DEBUG)
        for name in ("botocore", "botocore.endpoint", "urllib3.connectionpool", "kubernetes.client.rest"):
            assert not logging.getLogger(name).isEnabledFor(logging.DEBUG), name
            assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
