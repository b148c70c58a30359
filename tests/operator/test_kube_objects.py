"""The operator's generic object access (kube.py) against the real apiserver: any kind of a named group by
apiVersion and kind, found through discovery (owner walks read them; a restore through a StatefulSet
annotates it), with whatever kubernetes client version is installed."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest

from ibckpt_operator.cluster.kube import Kube

Cluster = Any  # conftest.py's fixture
pytestmark = [pytest.mark.kube]


def statefulset(name: str) -> dict[str, Any]:
    labels = {"app": name}
    container = {"name": "main", "image": "unused", "command": ["sleep", "1"]}
    return {
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def test_a_workload_is_read_and_annotated_by_api_version_and_kind(cluster_ns: Cluster) -> None:
    apps = kubernetes.client.AppsV1Api(cluster_ns.api)
    apps.create_namespaced_stateful_set(cluster_ns.namespace, statefulset("ring"))
    kube = Kube(cluster_ns.api)

    async def exercise() -> tuple[Any, ...]:
        ns = cluster_ns.namespace
        return (
            await kube.plural_of("apps/v1", "StatefulSet"),
            await kube.get_object("apps/v1", "StatefulSet", ns, "ring"),
            await kube.annotate("apps/v1", "StatefulSet", ns, "ring", {"ibckpt.io/restoring": "rsj-1"}),
            await kube.get_object("apps/v1", "StatefulSet", ns, "absent"),
            await kube.annotate("apps/v1", "StatefulSet", ns, "absent", {"a": "b"}),
            await kube.get_object("apps/v1", "NoSuchKind", ns, "ring"),
            await kube.get_object("no.such.group/v1", "Thing", ns, "ring"),
        )

    plural, found, annotated, absent, annotated_absent, unknown_kind, unknown_group = asyncio.run(exercise())
    assert plural == "statefulsets"
    assert found is not None and found["spec"]["selector"] == {"matchLabels": {"app": "ring"}}
    assert annotated is True
    live = apps.read_namespaced_stateful_set("ring", cluster_ns.namespace)
    assert live.metadata.annotations["ibckpt.io/restoring"] == "rsj-1"
    assert absent is None and annotated_absent is False
    assert unknown_kind is None and unknown_group is None
