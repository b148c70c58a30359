"""Reading a Secret with the agent's own service-account token (in-cluster, standard library only: the
agent imports the S3 store only when a session stages images)."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote

from ibckpt_node.agent.auth import SA_DIR

# (namespace, name) -> the Secret's data (base64 values, as the API returns them)
SecretReader = Callable[[str, str], Awaitable[dict[str, str]]]


class StagingError(Exception):
    """Reading the credentials or uploading the images failed; the message names no secret value."""


class KubeSecrets:
    """Reads a Secret with the agent's own service-account token (in-cluster, standard library)."""

    def __init__(
        self, url: str, ca_file: Path, token_file: Path, timeout_s: float = 10.0, grant_wait_s: float = 5.0
    ) -> None:
        self.url = url.rstrip("/")
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self.token_file = token_file
        self.timeout_s = timeout_s
        # The operator grants the read just before it calls (a Role by name): the apiserver's
        # authorizer may see that grant a moment later, so a 403 is asked again for this long.
        self.grant_wait_s = grant_wait_s

    @classmethod
    def in_cluster(cls) -> KubeSecrets:
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", SA_DIR / "ca.crt", SA_DIR / "token")

    async def __call__(self, namespace: str, name: str) -> dict[str, str]:
        return await asyncio.to_thread(self._read, namespace, name)

    def _read(self, namespace: str, name: str) -> dict[str, str]:
        deadline = time.monotonic() + self.grant_wait_s
        while True:
            try:
                return self._get(namespace, name)
            except urllib.error.HTTPError as exc:
                if exc.code != 403 or time.monotonic() >= deadline:
                    raise StagingError(f"cannot read Secret {namespace}/{name}: HTTP {exc.code}") from None
            except (OSError, ValueError) as exc:
                raise StagingError(f"cannot read Secret {namespace}/{name}: {exc}") from None
            time.sleep(0.5)

    def _get(self, namespace: str, name: str) -> dict[str, str]:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/secrets/{quote(name, safe='')}"
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token_file.read_text().strip()}"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as reply:
            data = json.load(reply).get("data") or {}
        return {str(k): str(v) for k, v in data.items()}
