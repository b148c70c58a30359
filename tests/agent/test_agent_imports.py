"""The agent's start imports no part of the image store: it is a third of the agent's modules (zstd,
cryptography, botocore), minutes of CPU on the testbed's emulated nodes, and only a staging needs it."""

from __future__ import annotations

import subprocess
import sys


def test_the_agent_starts_without_the_store() -> None:
    script = (
        "import sys\nimport ibckpt_node.agent.main\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('botocore', 'boto3', 'zstandard')"
        " or m.startswith('ibckpt.store')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert loaded.stdout.split() == [], loaded.stdout
