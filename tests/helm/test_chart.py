"""The Helm chart on the real two-node cluster: helm install, the agents Ready on both nodes, each
component's RBAC, and the agent API refusing every caller but the operator's service account.

The agent pods are hostNetwork and serve on their node's address; the calls come from a pod on the
pod network of the other node, through the product's own client (ibckpt.agentapi), as the operator's
do. Tokens are the service accounts' token Secrets (Kubernetes 1.20 has no TokenRequest in kubectl).
"""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime

import pytest
from helm.conftest import (
    AGENT_PORT,
    AGENT_SA,
    METRICS_PORT,
    NAMESPACE,
    OPERATOR_SA,
    RELEASE,
    STORAGE_SECRET,
    Release,
    sa_token,
)

from ibckpt.agentapi import agent_audience
from ibckpt.agentapi.memory import MEMORY_TIER_AUDIENCE
from testbed import pods
from testbed.cluster import NODE_NAMES, Cluster, node_ip
from testbed.images import PRODUCT_IMAGE
from testbed.release import audience_token

# The first test pays for the session's cluster (an image rebuild and two node boots: 10+ min on a
# loaded 2-core machine) and the install.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]


def test_agents_ready_on_both_nodes_and_the_operator_runs(installed: Release) -> None:
    cluster = installed.cluster
    assert f"{OPERATOR_SA}" in installed.notes and "ibckpt-runc" in installed.notes, installed.notes
    ds = pods.get(cluster, NAMESPACE, "daemonset", f"{RELEASE}-agent")
    assert (ds["status"]["desiredNumberScheduled"], ds["status"]["numberReady"]) == (2, 2), ds["status"]
    agents = installed.agent_pods()
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(NODE_NAMES)
    for p in agents:
        i = NODE_NAMES.index(p["spec"]["nodeName"]) + 1
        assert p["status"]["hostIP"] == p["status"]["podIP"] == node_ip(i)
        assert p["spec"]["containers"][0]["image"] == PRODUCT_IMAGE
    # started for real: it holds the Lease, its admission server and webhook configuration are up
    # (a missing RBAC rule for them crashed it minutes after it first looked ready)
    name = installed.operator_leading()
    time.sleep(10)
    operator = pods.get(cluster, NAMESPACE, "pod", name)
    [state] = operator["status"]["containerStatuses"]
    assert "running" in state["state"] and state["restartCount"] == 0, json.dumps(state, indent=1)


def test_the_agent_installed_the_node_pieces(installed: Release) -> None:
    for p in installed.agent_pods():
        name = p["metadata"]["name"]
        script = (
            "cat /host/etc/ibckpt/node.json; "
            "for f in ibckpt-runc ibckpt-hook; do cmp /usr/lib/ibckpt/ibckpt-front /host/usr/local/bin/$f "
            "&& echo front-$f; head -1 /host/usr/local/lib/ibckpt/launch/$f; done; "
            "readlink /host/usr/local/lib/ibckpt/runc; "
            "test -S /var/lib/ibckpt/registry.sock && echo registry-socket; "
            "stat -c '%a %U' /var/lib/ibckpt/registry.sock; "
            "build=$(sha256sum /usr/lib/ibckpt/libibckpt.so | cut -d' ' -f1); "
            "cmp /usr/lib/ibckpt/libibckpt.so /host/usr/local/lib/ibckpt/builds/$build/libibckpt.so "
            "&& echo same-shim; echo build=$build; "
            "cmp /usr/lib/ibckpt/criu/ibckpt_uverbs.so /host/usr/local/lib/ibckpt/criu/ibckpt_uverbs.so "
            "&& echo same-criu-plugin; "
            "echo handler-blocks: $(grep -c 'BEGIN ibckpt runtime handler' /host/etc/containerd/config.toml)"
        )
        out = installed.cluster.kubectl("exec", "-n", NAMESPACE, name, "--", "sh", "-c", script).stdout
        config = json.loads(out[: out.index("}") + 1])
        build = out.split("build=", 1)[1].split()[0]
        assert config == {
            "runc": "/usr/sbin/runc",
            # the image's shim build, kept under its digest: new containers mount it
            "shim": f"/usr/local/lib/ibckpt/builds/{build}/libibckpt.so",
            "hook": "/usr/local/bin/ibckpt-hook",
            "state_dir": "/var/lib/ibckpt",
        }
        # the compiled front as both entry points, Python's launchers behind it, runc linked for it
        launchers = "front-ibckpt-runc\n#!/usr/bin/python3 -IS\nfront-ibckpt-hook\n#!/usr/bin/python3 -IS\n"
        assert launchers + "/usr/sbin/runc\n" in out, out
        assert "registry-socket\n600 root\nsame-shim" in out, out
        # CRIU's plugin for a CheckpointJob's preDump, where runc's CRIU on the node loads it
        assert "\nsame-criu-plugin\n" in out, out
        # the nodes' containerd started with a stock config: the agent added the handler, once
        assert "handler-blocks: 1\n" in out, out
        node = pods.get(installed.cluster, NAMESPACE, "node", p["spec"]["nodeName"])
        assert node["metadata"]["labels"].get("ibckpt.io/runtime-ready") == "true", node["metadata"]


def _can(cluster: Cluster, account: str, *args: str) -> bool:
    proc = cluster.kubectl(
        "auth", "can-i", *args, f"--as=system:serviceaccount:{NAMESPACE}:{account}", check=False
    )
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stdout + proc.stderr
    return answer == "yes"


def test_each_component_may_do_what_it_needs_and_no_more(installed: Release) -> None:
    cluster = installed.cluster
    op, agent = OPERATOR_SA, AGENT_SA
    assert _can(cluster, op, "patch", "checkpointjobs.ibckpt.io", "--subresource=status", "-n", "team-a")
    assert _can(cluster, op, "watch", "checkpointstorages.ibckpt.io", "--all-namespaces")
    assert _can(cluster, op, "create", "checkpoints.ibckpt.io", "-n", "team-a")
    assert _can(cluster, op, "create", "events", "-n", "team-a")
    assert _can(cluster, op, "update", "leases.coordination.k8s.io", "-n", NAMESPACE)
    assert _can(cluster, op, "get", "secrets", "-n", "team-a")  # a CheckpointStorage's, by name
    assert not _can(cluster, op, "list", "secrets", "--all-namespaces")
    assert not _can(cluster, op, "delete", "nodes")
    assert not _can(cluster, op, "update", "leases.coordination.k8s.io", "-n", "kube-system")
    assert not _can(cluster, op, "create", "tokenreviews.authentication.k8s.io")
    # tokens for the agents: of its own account only (each bound to one node's agent)
    assert _can(
        cluster, op, "create", f"serviceaccounts/{OPERATOR_SA}", "--subresource=token", "-n", NAMESPACE
    )
    assert not _can(
        cluster, op, "create", f"serviceaccounts/{AGENT_SA}", "--subresource=token", "-n", NAMESPACE
    )
    assert not _can(cluster, op, "create", "serviceaccounts/default", "--subresource=token", "-n", "team-a")
    assert not _can(cluster, op, "delete", "customresourcedefinitions.apiextensions.k8s.io")
    # its internal TLS: the CA's Secret and the agents' certificate, by name (create cannot be narrowed)
    for kept in (f"{RELEASE}-internal-tls", f"{RELEASE}-agent-tls"):
        assert _can(cluster, op, "update", f"secrets/{kept}", "-n", NAMESPACE)
    assert not _can(cluster, op, "update", "secrets/other", "-n", NAMESPACE)
    # the agents' storage Role in a job's namespace: created, then read and updated by its name only
    grant = f"{AGENT_SA}-storage"
    assert _can(cluster, op, "create", "roles.rbac.authorization.k8s.io", "-n", "team-a")
    assert _can(cluster, op, "create", "rolebindings.rbac.authorization.k8s.io", "-n", "team-a")
    assert _can(cluster, op, "update", f"roles.rbac.authorization.k8s.io/{grant}", "-n", "team-a")
    assert not _can(cluster, op, "update", "roles.rbac.authorization.k8s.io/other", "-n", "team-a")
    assert not _can(cluster, op, "delete", f"roles.rbac.authorization.k8s.io/{grant}", "-n", "team-a")
    assert not _can(cluster, op, "create", "clusterroles.rbac.authorization.k8s.io")
    # the agents' ClusterRole owns those Roles (helm uninstall removes them): its uid, nothing more
    assert _can(cluster, op, "get", f"clusterroles.rbac.authorization.k8s.io/{RELEASE}-agent")
    assert not _can(cluster, op, "get", "clusterroles.rbac.authorization.k8s.io/cluster-admin")
    assert not _can(cluster, op, "delete", f"clusterroles.rbac.authorization.k8s.io/{RELEASE}-agent")
    assert not _can(cluster, op, "create", "clusterrolebindings.rbac.authorization.k8s.io")

    assert _can(cluster, agent, "create", "tokenreviews.authentication.k8s.io")
    assert _can(cluster, agent, "list", "pods", "--all-namespaces")
    # no chart-wide Secret name: a storage's Secret only where and once the operator granted it (a
    # job of that namespace did; the checkpoint tests' uploads prove the grant works end to end)
    assert not _can(cluster, agent, "get", f"secrets/{STORAGE_SECRET}", "-n", NAMESPACE)
    assert not _can(cluster, agent, "get", "secrets/other", "-n", NAMESPACE)
    assert not _can(cluster, agent, "list", "secrets", "-n", NAMESPACE)
    assert not _can(cluster, agent, "get", "secrets/other", "-n", "team-a")
    # the image keys reach the agents as a mounted volume only; no tenant may read them
    assert not _can(cluster, agent, "get", f"secrets/{RELEASE}-image-keys", "-n", NAMESPACE)
    tenant = cluster.kubectl("auth", "can-i", "get", f"secrets/{RELEASE}-image-keys", "-n", NAMESPACE,
                             "--as=jane", f"--as-group={RELEASE}-edit", check=False)  # fmt: skip
    assert tenant.stdout.strip() == "no", tenant.stdout + tenant.stderr
    # the CA's key is the operator's alone: the agents' pods mount their own certificate, not read it
    assert not _can(cluster, agent, "get", f"secrets/{RELEASE}-internal-tls", "-n", NAMESPACE)
    assert not _can(cluster, agent, "create", "pods", "-n", NAMESPACE)
    assert not _can(cluster, agent, "get", "checkpointjobs.ibckpt.io", "-n", "team-a")
    # its own node's runtime-ready label and Events (RBAC cannot narrow a node patch to one node)
    assert _can(cluster, agent, "patch", "nodes")
    assert _can(cluster, agent, "create", "events", "-n", "default")
    assert not _can(cluster, agent, "delete", "nodes")
    assert _can(cluster, agent, "get", f"daemonsets.apps/{RELEASE}-agent", "-n", NAMESPACE)
    assert not _can(cluster, agent, "get", "daemonsets.apps/other", "-n", NAMESPACE)

    assert not _can(cluster, "default", "create", "tokenreviews.authentication.k8s.io")


# Runs in a pod with the product image: the operator's client against each node's agent.
CALLER = """
import http.client, json, socket, ssl, urllib.request
from ibckpt.agentapi import AgentClient, AgentError
from ibckpt.tls import AGENT_SERVER_NAME, client_context
cfg = json.loads(CONFIG)
tls = client_context(cfg["ca"].encode())
out = {}
for node, ip in cfg["nodes"].items():
    r = {"healthy": AgentClient(ip, cfg["port"], tls=tls, token="-", timeout_s=30).healthy()}
    conn = http.client.HTTPConnection(ip, cfg["port"], timeout=30)
    sock = socket.create_connection((ip, cfg["port"]), 30)
    conn.sock = tls.wrap_socket(sock, server_hostname=AGENT_SERVER_NAME)
    conn.request("GET", "/v1/info")
    reply = conn.getresponse()
    r["anonymous"] = {"status": reply.status, "body": reply.read().decode()}
    plain = http.client.HTTPConnection(ip, cfg["port"], timeout=30)
    try:
        plain.request("GET", "/healthz")
        r["plain"] = plain.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        r["plain"] = type(exc).__name__
    # as the leader calls: with its epoch; then with none, and with an older Lease's (a deposed leader's)
    leader = tuple(cfg["epoch"])
    calls = [(who, token, leader) for who, token in cfg["tokens"][node].items()]
    operator = cfg["tokens"][node]["operator"]
    calls += [("unfenced", operator, None), ("deposed", operator, (leader[0] - 1, 9))]
    for who, token, epoch in calls:
        try:
            info = AgentClient(ip, cfg["port"], tls=tls, token=token, timeout_s=30, leader_epoch=epoch).info()
            r[who] = {"status": 200, "info": info.to_wire()}
        except AgentError as exc:
            r[who] = {"status": exc.status, "error": exc.message}
    # the memory tier's routes, as another node's agent calls them
    for who in ("memory", "memoryDefault"):
        conn = http.client.HTTPConnection(ip, cfg["port"], timeout=30)
        sock = socket.create_connection((ip, cfg["port"]), 30)
        conn.sock = tls.wrap_socket(sock, server_hostname=AGENT_SERVER_NAME)
        token = cfg["tokens"][node][who]
        conn.request("GET", "/v1/memory/copies", headers={"Authorization": "Bearer " + token})
        reply = conn.getresponse()
        r["copies-" + who] = {"status": reply.status, "body": reply.read().decode()[:2000]}
    text = urllib.request.urlopen(f"http://{ip}:{cfg['metrics']}/metrics", timeout=30).read().decode()
    r["metrics"] = [line for line in text.splitlines() if line.startswith("ibckpt_agent_requests_total")]
    out[node] = r
# an AdmissionReview, as the apiserver would post one, from a pod: no client certificate
w = cfg["webhook"]
socket.create_connection((w["ip"], w["port"]), 30).close()  # the port answers (raises otherwise)
bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "forged", "operation": "CREATE", "namespace": "default", "name": "x",
    "kind": {"group": "policy", "version": "v1beta1", "kind": "Eviction"}, "object": {}}}
try:
    conn = http.client.HTTPSConnection(w["ip"], w["port"], timeout=30, context=bare)
    conn.request("POST", "/eviction", body=json.dumps(review), headers={"Content-Type": "application/json"})
    out["admission"] = {"status": conn.getresponse().status}
except (OSError, http.client.HTTPException) as exc:
    out["admission"] = {"error": f"{type(exc).__name__}: {exc}"}
print("RESULT " + json.dumps(out))
"""


def _agents_ca(cluster: Cluster) -> str:
    """The CA the operator wrote beside the agents' certificate (public: a certificate, no key)."""
    secret = json.loads(
        cluster.kubectl("get", "secret", f"{RELEASE}-agent-tls", "-n", NAMESPACE, "-o", "json").stdout
    )
    return base64.b64decode(secret["data"]["ca.crt"]).decode()


def test_the_agent_api_answers_only_the_operator(installed: Release) -> None:
    cluster = installed.cluster
    # per node, as the operator requests them (cluster/agenttokens.py): bound to that node's agent alone
    tokens = {
        node: {
            "operator": audience_token(cluster, NAMESPACE, OPERATOR_SA, agent_audience(node)),
            # taken from a call to the other node's agent, replayed here
            "replayed": audience_token(cluster, NAMESPACE, OPERATOR_SA, agent_audience(other)),
            "legacy": sa_token(cluster, NAMESPACE, OPERATOR_SA),
            "apiserver": audience_token(cluster, NAMESPACE, OPERATOR_SA, "https://kubernetes.default.svc"),
            "agent": audience_token(cluster, NAMESPACE, AGENT_SA, agent_audience(node)),
            "default": audience_token(cluster, NAMESPACE, "default", agent_audience(node)),
            # the agents' own token for each other's memory tier, and another account's of that audience
            "memory": audience_token(cluster, NAMESPACE, AGENT_SA, MEMORY_TIER_AUDIENCE),
            "memoryDefault": audience_token(cluster, NAMESPACE, "default", MEMORY_TIER_AUDIENCE),
            "forged": "eyJhbGciOiJSUzI1NiJ9.e30.forged",
        }
        for node, other in zip(NODE_NAMES, reversed(NODE_NAMES), strict=True)
    }
    caller = pods.product_pod("caller", "node-2", PRODUCT_IMAGE)
    pods.apply(cluster, NAMESPACE, caller)
    try:
        pods.wait_pod(cluster, NAMESPACE, "caller", {"Running"})
        lease = json.loads(
            cluster.kubectl("get", "lease", "ibckpt-operator", "-n", NAMESPACE, "-o", "json").stdout
        )
        made = datetime.fromisoformat(lease["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        epoch = [int(made.timestamp()), lease["spec"].get("leaseTransitions", 0)]
        leader = cluster.kubectl(
            "get", "pod", lease["spec"]["holderIdentity"], "-n", NAMESPACE, "-o", "jsonpath={.status.podIP}"
        ).stdout.strip()
        config = {
            "webhook": {"ip": leader, "port": cluster.webhook_port},
            "ca": _agents_ca(cluster),
            "epoch": epoch,
            "nodes": {n: node_ip(i) for i, n in enumerate(NODE_NAMES, 1)},
            "port": AGENT_PORT,
            "metrics": METRICS_PORT,
            "tokens": tokens,
        }
        # the tokens travel on stdin, never on a command line
        script = f"CONFIG = {json.dumps(json.dumps(config))}\n{CALLER}"
        proc = cluster.kubectl(
            "exec", "-i", "-n", NAMESPACE, "caller", "--", "python3", "-", stdin=script, timeout=300
        )
        result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    finally:
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, "caller", "--timeout=60s", check=False, timeout=90)
    for i, node in enumerate(NODE_NAMES, 1):
        r = result[node]
        assert r["healthy"] is True
        assert not isinstance(r["plain"], int), r  # TLS only: plain HTTP gets no HTTP status back
        assert r["anonymous"]["status"] == 401, r
        assert r["forged"]["status"] == 401, r
        assert r["agent"]["status"] == 403, r
        assert (
            f"system:serviceaccount:{NAMESPACE}:{AGENT_SA} may not use the node agent" in r["agent"]["error"]
        )
        assert r["default"]["status"] == 403, r
        assert r["operator"]["status"] == 200, r
        # the agents' memory-tier token opens the memory routes alone, and only for the agents' account
        assert r["memory"]["status"] == 401 and r["memoryDefault"]["status"] == 401, r
        assert r["copies-memory"]["status"] == 200, r
        assert r["copies-memoryDefault"]["status"] == 403, r
        # the operator's own tokens for any other audience are not the agents' to accept
        assert r["legacy"]["status"] == 401 and r["apiserver"]["status"] == 401, r
        # nor another node's agent's: a token taken from one call is worthless at any other agent
        assert r["replayed"]["status"] == 401, r
        # the leader's epoch fences off a caller without one, and a deposed leader's
        assert r["unfenced"]["status"] == 409 and "carries no leader epoch" in r["unfenced"]["error"], r
        assert r["deposed"]["status"] == 409 and "was deposed" in r["deposed"]["error"], r
        info = r["operator"]["info"]
        assert (info["node"], info["ready"], info["address"]) == (node, True, f"{node_ip(i)}:{AGENT_PORT}")
        assert info["shimPresent"] is True
        assert info["shimPath"] == f"/usr/local/lib/ibckpt/builds/{info['shimSha256']}/libibckpt.so"
        assert info["shimSha256"] in info["shimBuilds"], info
        counted = {line.split("{", 1)[1].split("}", 1)[0] for line in r["metrics"]}
        assert 'code="200",route="/v1/info"' in counted, r["metrics"]
        assert 'code="403",route="/v1/info"' in counted, r["metrics"]
        assert 'code="401",route="/v1/info"' in counted, r["metrics"]
    # the apiserver's webhook client certificate is required (the chart's clientCA): a review posted
    # from a pod gets no answer, while the apiserver's own calls do (tests/helm/test_drain.py)
    assert "status" not in result["admission"], result["admission"]
    # no token reached a log
    logs = cluster.kubectl(
        "logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=agent", "--tail=-1"
    ).stdout
    assert "may not use the node agent" in logs or "refused" in logs, logs[-2000:]
    for token in (t for per_node in tokens.values() for t in per_node.values()):
        assert token not in logs
