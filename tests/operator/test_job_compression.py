"""spec.compression through the operator, against the real apiserver and the real S3: each node agent's
checkpoint request carries the job's choice, and the manifest the operator commits records it. The node
agent is the fake of testbed/fake_agent.py, which stages its part the way the real agent's staging does
(tests/agent/test_agent_compression.py has the real agent and the stored bytes)."""

from __future__ import annotations

from typing import Any

import pytest

from ibckpt.store import ImageStore
from testbed.s3 import S3Server

pytestmark = [pytest.mark.kube, pytest.mark.s3]
Agents = Cluster = Any  # conftest.py's fixtures


def job(name: str, s3: S3Server, bucket: str, **spec: Any) -> dict[str, Any]:
    location = {
        "endpoint": s3.endpoint,
        "region": s3.region,
        "bucket": bucket,
        "credentialsSecretRef": {"name": "s3-creds"},
    }
    return {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": {"storage": location, "selector": {"matchLabels": {"app": "ring"}}, **spec},
    }


def test_each_agent_is_asked_for_the_jobs_compression_and_the_manifest_records_it(
    cluster_ns: Cluster, s3_server: S3Server, bucket: str, agents: Agents, operator: Any, store_config: Any
) -> None:
    config = store_config(bucket)
    a = agents.add(cluster_ns, "node-a", 1, "complete", config)
    b = agents.add(cluster_ns, "node-b", 2, "complete", config)
    cluster_ns.rank_pod(a, "ring-0", {"app": "ring"})
    cluster_ns.rank_pod(b, "ring-1", {"app": "ring"})
    cluster_ns.secret(
        "s3-creds", {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    )
    store = ImageStore.open(config)
    succeeded = lambda body: (body.get("status") or {}).get("phase") == "Succeeded"  # noqa: E731
    with operator():
        # one job after the other over the same pods: "none", then the default
        for name, spec, codec in (("plain", {"compression": "none"}, "none"), ("packed", {}, "zstd")):
            cluster_ns.create("checkpointjobs", job(name, s3_server, bucket, **spec))
            body = cluster_ns.wait("checkpointjobs", name, succeeded, timeout=90)
            asked = [agent.requests[-1].images for agent in (a, b)]
            assert [images.codec for images in asked if images is not None] == [codec, codec]
            ref = store.context.layout.ref_from_manifest_key(body["status"]["manifestKey"])
            assert ref is not None and store.manifest(ref).compression.codec == codec
