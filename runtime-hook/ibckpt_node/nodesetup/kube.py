"""The agent's Node calls: read it, label it, post Events on it, and read the agent's own DaemonSet
(in-cluster, standard library, with the pod's service-account token, as kubesecrets does)."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NodeApi:
    def __init__(self, url: str, ca_file: Path, token_file: Path, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.context = ssl.create_default_context(cafile=str(ca_file))
        self.token_file = token_file
        self.timeout_s = timeout_s

    @classmethod
    def in_cluster(cls) -> NodeApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", SA_DIR / "ca.crt", SA_DIR / "token")

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {
            "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            "Accept": "application/json",
        }
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            raise KubeError(exc.code, f"{method} {path}: HTTP {exc.code}") from None
        except (OSError, ValueError) as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from None

    def node(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/v1/nodes/{quote(name, safe='')}"))

    def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._call("PATCH", f"/api/v1/nodes/{quote(name, safe='')}", patch, "application/merge-patch+json")

    def post_event(self, event: dict[str, Any]) -> None:
        try:
            self._call("POST", "/api/v1/namespaces/default/events", event)
        except KubeError as exc:
            if exc.status != 409:  # the same event from an earlier start of this agent
                raise

    def daemonset(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DaemonSet, or None when it is gone."""
        path = f"/apis/apps/v1/namespaces/{quote(namespace, safe='')}/daemonsets/{quote(name, safe='')}"
        try:
            return dict(self._call("GET", path))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete_daemonset(self, namespace: str, name: str) -> None:
        path = f"/apis/apps/v1/namespaces/{quote(namespace, safe='')}/daemonsets/{quote(name, safe='')}"
        try:
            self._call(
                "DELETE",
                path,
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status != 404:
                raise

    def pod_names(self, namespace: str, selector: str) -> list[str]:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods?labelSelector={quote(selector, safe='')}"
        return [str(p["metadata"]["name"]) for p in self._call("GET", path).get("items", [])]

    def node_names(self, selector: str) -> list[str]:
        path = f"/api/v1/nodes?labelSelector={quote(selector, safe='')}"
        return [str(n["metadata"]["name"]) for n in self._call("GET", path).get("items", [])]
