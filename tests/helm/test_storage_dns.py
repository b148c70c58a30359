"""A CheckpointStorage whose endpoint is an in-cluster Service's name and whose credentials are in a
Secret of the team's own name (issue 30): the operator reaches the bucket through the name, and the agents,
on their nodes' network, resolve it through the cluster DNS (the testbed's, testbed/dns.py)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
from helm.conftest import NAMESPACE, Release

from testbed import pods, ring
from testbed.dns import DNS_NAME, DNS_NS, wait_cluster_dns
from testbed.s3 import S3Server

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900), pytest.mark.budget(minutes=5)]


def test_a_storage_named_by_an_in_cluster_service_with_its_own_secret_is_reached(
    installed: Release, s3_server: S3Server
) -> None:
    """An S3 endpoint given as a Service's name, as a team running its S3 in the cluster writes it (here a
    headless Service whose Endpoints are the host's S3), with credentials in a Secret of the team's own
    name. The operator (pod network) reaches the bucket through the name, and the agents, on their nodes'
    network, resolve it through the cluster DNS (agent.dnsPolicy ClusterFirstWithHostNet) and connect."""
    cluster = installed.cluster
    wait_cluster_dns(cluster)
    ns, secret = "team-dns", "team-dns-s3-keys"
    host = f"s3.{ns}.svc.cluster.local"
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    bucket = f"dns-{secrets.token_hex(3)}"
    s3_server.create_bucket(bucket)
    pods.namespace(cluster, ns)
    try:
        cluster.kubectl(
            "create", "secret", "generic", secret, "-n", ns,
            f"--from-literal=AWS_ACCESS_KEY_ID={s3_server.access_key}",
            f"--from-literal=AWS_SECRET_ACCESS_KEY={s3_server.secret_key}",
        )  # fmt: skip
        service: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s3"}}
        service["spec"] = {"clusterIP": "None", "ports": [{"port": port}]}
        endpoints: dict[str, Any] = {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "s3"}}
        endpoints["subsets"] = [{"addresses": [{"ip": "10.0.2.100"}], "ports": [{"port": port}]}]
        storage = ring.storage(s3_server.endpoint, bucket)
        storage["spec"]["endpoint"] = f"http://{host}:{port}"
        storage["spec"]["credentialsSecretRef"] = {"name": secret}
        pods.apply(cluster, ns, service, endpoints, storage)

        deadline = time.monotonic() + 300
        ready: dict[str, str] = {}
        while time.monotonic() < deadline:
            status = pods.get(cluster, ns, "checkpointstorage", "store").get("status") or {}
            ready = next((c for c in status.get("conditions") or () if c["type"] == "Ready"), {})
            if ready.get("status") == "True":
                break
            time.sleep(3)
        assert ready.get("status") == "True", (ready, dns_log(installed))

        # what boto3 does first from the agent's network: getaddrinfo, then a connection
        # as botocore would: a failed name lookup or connection is tried again, here for up to a minute
        connect = "\n".join([
            "import socket, time",
            "deadline = time.monotonic() + 60",
            "while True:",
            "    try:",
            f"        print(socket.create_connection(({host!r}, {port}), timeout=20).getpeername()[0])",
            "        break",
            "    except OSError:",
            "        if time.monotonic() > deadline:",
            "            raise",
            "        time.sleep(2)",
        ])  # fmt: skip
        for agent in installed.agent_pods():
            name = agent["metadata"]["name"]
            resolv = cluster.kubectl(
                "exec", "-n", NAMESPACE, name, "--", "cat", "/etc/resolv.conf", check=False
            )
            assert f"search {NAMESPACE}.svc.cluster.local" in resolv.stdout, (resolv.stdout, resolv.stderr)
            reached = cluster.kubectl(
                "exec", "-n", NAMESPACE, name, "--", "python3", "-c", connect, check=False
            )  # fmt: skip
            got = (name, reached.stdout[-500:], reached.stderr[-1500:], resolv.stdout)
            assert reached.stdout.strip() == "10.0.2.100", (got, dns_log(installed))
    finally:
        pods.delete_namespace(cluster, ns)


def dns_log(installed: Release) -> str:
    """What the testbed's DNS said (its errors: the apiserver out of reach, say)."""
    logs = installed.cluster.kubectl("logs", "-n", DNS_NS, "-l", f"app={DNS_NAME}", check=False)
    return (logs.stdout + logs.stderr)[-2000:]
