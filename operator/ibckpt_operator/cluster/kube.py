"""The Kubernetes calls the operator makes, through the official client, each run off the event loop.

Nothing here decides anything: the machines decide, this reads and writes objects. This module and
leader.py are the only ones that import the client (import-linter); the others catch its ApiException
from here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from datetime import UTC, datetime
from typing import Any

import kubernetes
from kubernetes.client import ApiException as ApiException

from ibckpt.api import GROUP, VERSION
from ibckpt_operator.config import COMPONENT

log = logging.getLogger(__name__)
Body = dict[str, Any]


def client_configuration() -> kubernetes.client.Configuration:
    """In a pod: its service account; elsewhere: $KUBECONFIG (read now, not at import) or ~/.kube/config."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)  # type: ignore[no-untyped-call]
    return configuration


def new_api_client() -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(client_configuration())


def is_status(error: BaseException, *codes: int) -> bool:
    return isinstance(error, ApiException) and error.status in codes


def api_message(error: ApiException) -> str:
    """The apiserver's own message for a refused call (its Status body), else the HTTP reason."""
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self._plurals: dict[tuple[str, str], str] = {}

    @staticmethod
    async def _run(call: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(call, *args, **kwargs)

    async def _read(self, call: Any, *args: Any) -> Body | None:
        """One GET through `call`, its JSON as a dict; None if there is no such object (404)."""
        try:
            return _json(await self._run(call, *args, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Body | None:
        """One request on the raw API; None for 404. Written against the client's request layer
        (param_serialize + call_api): ApiClient.call_api's old keywords are gone in recent clients."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialize: Any = self.api.param_serialize
        verb, url, headers, payload, _ = serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        request: Any = self.api.call_api
        response = await asyncio.to_thread(request, verb, url, header_params=headers, body=payload)
        data = response.read()
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response)
        return dict(json.loads(data)) if data else {}

    # -- plain objects as dicts (the models read them; the client's own classes are not used)

    async def list_pods(self, namespace: str, label_selector: str | None = None) -> list[Body]:
        kwargs = {"label_selector": label_selector} if label_selector else {}
        result = await self._run(self.core.list_namespaced_pod, namespace, _preload_content=False, **kwargs)
        return list(_json(result).get("items", []))

    async def get_pod(self, namespace: str, name: str) -> Body | None:
        return await self._read(self.core.read_namespaced_pod, name, namespace)

    async def list_nodes(self) -> list[Body]:
        result = await self._run(self.core.list_node, _preload_content=False)
        return list(_json(result).get("items", []))

    async def create_pod(self, namespace: str, body: Body) -> str:
        """Create a pod (a restore's, or a bare one a recovery starts again); its uid."""
        result = await self._run(self.core.create_namespaced_pod, namespace, body, _preload_content=False)
        return str(_json(result)["metadata"]["uid"])

    async def delete_pod(self, namespace: str, name: str, uid: str, grace_seconds: int | None = None) -> bool:
        """Delete the pod only if it is still this UID; False if it is gone (or another pod by now).
        `grace_seconds` 0 removes the object at once, without waiting for the kubelet's cleanup."""
        body = kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=uid), grace_period_seconds=grace_seconds
        )
        try:
            await self._run(self.core.delete_namespaced_pod, name, namespace, body=body)
            return True
        except ApiException as error:
            if error.status in (404, 409):
                return False
            raise

    async def get_secret(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data (base64 values), or None if there is no such Secret."""
        secret = await self._read(self.core.read_namespaced_secret, name, namespace)
        return None if secret is None else dict(secret.get("data") or {})

    # Any kind of a named API group, through the custom-objects client (its paths are /apis/<group>/...):
    # apps, batch, jobset.x-k8s.io, kubeflow.org, ... The core group ("v1") is not walked: of its kinds
    # only a ReplicationController owns pods.

    async def plural_of(self, api_version: str, kind: str) -> str | None:
        """The resource name of a kind in a named group, from the apiserver's discovery (cached)."""
        key = (api_version, kind)
        if key not in self._plurals and "/" in api_version:
            group, version = api_version.split("/", 1)
            found = await self._read(self.custom.get_api_resources, group, version)
            if found is None:
                return None
            for resource in found.get("resources", []):
                if "/" not in resource.get("name", ""):
                    self._plurals[(api_version, resource.get("kind", ""))] = resource["name"]
        return self._plurals.get(key)

    async def get_object(self, api_version: str, kind: str, namespace: str, name: str) -> Body | None:
        """Any namespaced object of a named group by apiVersion and kind (owner walks); None if absent or
        unknown."""
        plural = await self.plural_of(api_version, kind)
        if plural is None:
            return None
        group, version = api_version.split("/", 1)
        return await self._get_namespaced(group, version, plural, namespace, name)

    async def annotate(
        self, api_version: str, kind: str, namespace: str, name: str, annotations: dict[str, str]
    ) -> bool:
        """Set annotations on any namespaced object of a named group (a merge patch); False if it is
        absent or unknown."""
        plural = await self.plural_of(api_version, kind)
        if plural is None:
            return False
        group, version = api_version.split("/", 1)
        body = {"metadata": {"annotations": annotations}}
        try:
            await self._run(
                self.custom.patch_namespaced_custom_object, group, version, namespace, plural, name, body
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    # -- our own kinds

    async def get_custom(self, plural: str, namespace: str, name: str) -> Body | None:
        return await self._get_namespaced(GROUP, VERSION, plural, namespace, name)

    async def _get_namespaced(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> Body | None:
        return await self._read(
            self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
        )

    async def list_custom(self, plural: str) -> list[Body]:
        result = await self._run(self.custom.list_cluster_custom_object, GROUP, VERSION, plural)
        return list(result.get("items", []))

    async def create_custom(self, plural: str, namespace: str, body: Body) -> bool:
        """Create if absent: False when an object of that name exists already."""
        try:
            await self._run(
                self.custom.create_namespaced_custom_object, GROUP, VERSION, namespace, plural, body
            )
            return True
        except ApiException as error:
            if error.status == 409:
                return False
            raise

    async def patch_custom(self, plural: str, namespace: str, name: str, body: Body) -> None:
        """A merge patch of one of our objects (its spec: a RestoreJob's chosen Checkpoint)."""
        await self._run(
            self.custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, plural, name, body
        )

    async def patch_status(self, plural: str, namespace: str, name: str, status: Body) -> None:
        await self._run(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            plural,
            name,
            {"status": status},
        )

    # -- Events

    async def post_event(
        self, involved: Body, type_: str, reason: str, message: str, *, api_version: str | None = None
    ) -> None:
        """A core/v1 Event about `involved` (an object body). Failing to post one never fails a job."""
        meta = involved.get("metadata", {})
        now = datetime.now(UTC)
        event = kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(generate_name=f"{meta.get('name', 'ibckpt')}."),
            involved_object=kubernetes.client.V1ObjectReference(
                api_version=api_version or involved.get("apiVersion"),
                kind=involved.get("kind"),
                name=meta.get("name"),
                namespace=meta.get("namespace"),
                uid=meta.get("uid"),
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            source=kubernetes.client.V1EventSource(component=COMPONENT),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            reporting_component=COMPONENT,
        )
        try:
            await self._run(self.core.create_namespaced_event, meta.get("namespace") or "default", event)
        except ApiException as error:
            log.warning("could not post Event %s on %s: %s", reason, meta.get("name"), error.reason)


def _json(response: Any) -> Body:
    import json

    data = response.data if hasattr(response, "data") else response
    return dict(json.loads(data))
