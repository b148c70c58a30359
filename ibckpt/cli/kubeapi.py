"""The plugin's view of the cluster: the user's kubeconfig, their namespace, and the ibckpt kinds.

Everything goes through the apiserver as the user, so RBAC decides what they may do; the plugin holds
no credentials of its own."""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ibckpt.api import GROUP, VERSION, KindInfo

Body = dict[str, Any]


class PluginError(Exception):
    """A refusal or a failure to tell the user in one line (exit code 1)."""


@dataclass
class KubeApi:
    client: Any  # kubernetes.client.ApiClient
    namespace: str

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None, namespace: str | None) -> KubeApi:
        import kubernetes  # only the plugin needs it, not `ibckpt images`

        try:
            client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise PluginError(f"cannot load the kubeconfig: {exc}") from None
        if namespace is None:
            try:
                contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
                chosen = next((c for c in contexts if c["name"] == context), active) if context else active
                namespace = (chosen or {}).get("context", {}).get("namespace")
            except (kubernetes.config.ConfigException, OSError):
                namespace = None
        return cls(client, namespace or "default")

    @property
    def _custom(self) -> Any:
        import kubernetes

        return kubernetes.client.CustomObjectsApi(self.client)

    @property
    def core(self) -> Any:
        import kubernetes

        return kubernetes.client.CoreV1Api(self.client)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import kubernetes

        try:
            return fn(*args, **kwargs)
        except kubernetes.client.ApiException as exc:
            raise PluginError(f"{what}: {_reason(exc)}") from None

    def create(self, kind: KindInfo, body: Body) -> Body:
        what = f"creating {kind.kind} {body['metadata'].get('name') or body['metadata'].get('generateName')}"
        return dict(
            self._call(
                what,
                self._custom.create_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                kind.plural,
                body,
            )
        )

    def annotate(self, kind: KindInfo, name: str, annotations: dict[str, str]) -> Body:
        patch = {"metadata": {"annotations": annotations}}
        return dict(
            self._call(
                f"annotating {kind.kind} {name}",
                self._custom.patch_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                kind.plural,
                name,
                patch,
            )
        )

    def get(self, kind: KindInfo, name: str) -> Body | None:
        import kubernetes

        try:
            return dict(
                self._custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, kind.plural, name)
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise PluginError(f"reading {kind.kind} {name}: {_reason(exc)}") from None

    def must_get(self, kind: KindInfo, name: str) -> Body:
        found = self.get(kind, name)
        if found is None:
            raise PluginError(f"{kind.kind} {name} not found in namespace {self.namespace}")
        return found

    def list(self, kind: KindInfo, all_namespaces: bool = False, labels: str | None = None) -> list[Body]:
        what = f"listing {kind.plural}"
        extra = {"label_selector": labels} if labels else {}
        if all_namespaces:
            found = self._call(
                what, self._custom.list_cluster_custom_object, GROUP, VERSION, kind.plural, **extra
            )
        else:
            found = self._call(
                what,
                self._custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                kind.plural,
                **extra,
            )
        return list(found.get("items", []))

    def watch(self, kind: KindInfo, name: str, seconds: float) -> Iterator[Body]:
        """The object as it is now, then each change of it, for at most `seconds` (a watch sees every
        status write, where polling would skip the phases that pass quickly)."""
        import kubernetes

        deadline = time.monotonic() + seconds
        version = None
        while (left := deadline - time.monotonic()) > 0:
            if version is None:
                body = self.must_get(kind, name)
                version = body["metadata"]["resourceVersion"]
                yield body
            stream = kubernetes.watch.Watch().stream(  # type: ignore[no-untyped-call]
                self._custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                kind.plural,
                field_selector=f"metadata.name={name}",
                resource_version=version,
                timeout_seconds=max(1, min(int(left), 60)),
            )
            try:
                for event in stream:
                    if event["type"] == "DELETED":
                        raise PluginError(f"{kind.kind} {name} was deleted")
                    if event["type"] == "ERROR":  # e.g. the version is too old: read it again
                        version = None
                        break
                    version = event["object"]["metadata"]["resourceVersion"]
                    yield dict(event["object"])
            except kubernetes.client.ApiException as exc:
                if exc.status != 410:
                    raise PluginError(f"watching {kind.kind} {name}: {_reason(exc)}") from None
                version = None

    def pod(self, name: str) -> Body:
        pod = self._call(f"reading pod {name}", self.core.read_namespaced_pod, name, self.namespace)
        return dict(self.client.sanitize_for_serialization(pod))

    def pods(self, namespace: str, selector: str) -> builtins.list[Body]:
        found = self._call(
            f"listing pods in {namespace}", self.core.list_namespaced_pod, namespace, label_selector=selector
        )
        return [dict(self.client.sanitize_for_serialization(p)) for p in found.items]

    def pod_log(self, namespace: str, name: str, since_seconds: int) -> str:
        read = self.core.read_namespaced_pod_log
        return str(
            self._call(
                f"reading the log of {namespace}/{name}", read, name, namespace, since_seconds=since_seconds
            )
        )

    def raw(self, method: str, path: str) -> Body | None:
        """One request on the raw API, as JSON; None for 404 (for kinds whose version the client lacks,
        such as policy/v1beta1 PodDisruptionBudgets of clusters before 1.21)."""
        import json

        serialize: Any = self.client.param_serialize
        verb, url, headers, payload, _ = serialize(
            method, path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
        )
        call: Any = self.client.call_api
        try:
            response = call(verb, url, header_params=headers, body=payload)
        except OSError as exc:
            raise PluginError(f"{method} {path}: {exc}") from None
        data = response.read()
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            raise PluginError(f"{method} {path}: {response.status} {data[:300]!r}")
        return dict(json.loads(data)) if data else {}

    def owner(self, api_version: str, kind: str, name: str) -> Body | None:
        """An owner object by apiVersion/kind/name, as JSON; None when it is not readable (the walk up
        from a pod then stops there)."""
        import kubernetes

        group, _, version = api_version.rpartition("/")
        if not group:  # the core group owns no pods' workloads that ibckpt names
            return None
        plural = kind.lower() + "s"  # the built-in owners of pods: ReplicaSet, Job, StatefulSet, ...
        try:
            found = self._custom.get_namespaced_custom_object(group, version, self.namespace, plural, name)
        except kubernetes.client.ApiException:
            return None
        return dict(found)


def _reason(exc: Any) -> str:
    import json

    try:
        message = json.loads(exc.body or "{}").get("message")
    except ValueError:
        message = None
    return str(message or exc.reason or exc)
