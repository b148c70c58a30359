"""The Helm chart lints, renders, and every object it renders is accepted by the real apiserver."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from testbed.guest import cache_dir

pytestmark = pytest.mark.kube

CHART = Path(__file__).resolve().parents[2] / "charts" / "ibckpt"
ACCELERATOR_VALUES = CHART.parents[1] / "docs" / "examples" / "accelerator-values.yaml"


def tool(name: str) -> str:
    path = cache_dir() / "helm" / name
    assert path.exists(), f"{path} missing: run tests/testbed/fetch-helm.sh (make helm)"
    return str(path)


def template(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("helm"), "template", "ibckpt", str(CHART), *args], capture_output=True, text=True, check=check
    )


def test_chart_lints_strict() -> None:
    out = subprocess.run([tool("helm"), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_chart_passes_server_dry_run(kube, kube_api: kubernetes.client.ApiClient) -> None:  # type: ignore[no-untyped-def]
    # Its own namespace: the operator tests share this apiserver and create ibckpt-system themselves.
    namespace = "ibckpt-smoke"
    kubernetes.client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": namespace}})
    # every optional value a real cluster sets, so the server checks what they render to
    rendered = template(
        "--namespace", namespace, "--include-crds", "--set", "imagePullSecrets[0]=registry-login",
        "--set", "operator.priorityClassName=system-cluster-critical",
        "--set", "operator.podAnnotations.team=ml", "--set", "agent.podAnnotations.team=ml",
        "--set", "operator.extraEnv[0].name=HTTPS_PROXY", "--set", "operator.extraEnv[0].value=http://proxy:3128",
        "--set", "agent.extraEnv[0].name=NO_PROXY", "--set", "agent.extraEnv[0].value=.svc",
        "--set", "agent.stopTimeoutSeconds=300", "-f", str(ACCELERATOR_VALUES),
        "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.nodeCIDRs={10.0.0.0/24}",
        "--set", "networkPolicy.apiserverCIDRs={10.0.0.1/32}",
        "--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
        "--set", "operator.webhook.clientCA.secretName=apiserver-webhook-client-ca",
    ).stdout  # fmt: skip
    objects = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in objects)
    assert kinds.count("CustomResourceDefinition") == 5
    assert {"Deployment", "DaemonSet", "ClusterRole", "ServiceAccount"} <= set(kinds)
    assert kinds.count("Service") == 2  # the operator's metrics, the agents' (headless)
    assert kinds.count("NetworkPolicy") == 1
    pods = {d["kind"]: d["spec"]["template"] for d in objects if d["kind"] in ("Deployment", "DaemonSet")}
    for template_ in pods.values():
        assert template_["spec"]["imagePullSecrets"] == [{"name": "registry-login"}]
        assert template_["metadata"]["annotations"] == {"team": "ml"}
    operator, agent = pods["Deployment"]["spec"], pods["DaemonSet"]["spec"]
    assert operator["priorityClassName"] == "system-cluster-critical"
    assert operator["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in operator["containers"][0]["env"]
    assert {"name": "NO_PROXY", "value": ".svc"} in agent["containers"][0]["env"]
    # the agent's grace outlasts its own wait for aborted sessions
    assert "--stop-timeout=300" in agent["containers"][0]["args"]
    assert agent["terminationGracePeriodSeconds"] == 315
    applied = subprocess.run(
        [tool("kubectl"), f"--kubeconfig={kube.kubeconfig}", "apply", "--dry-run=server", "-f", "-"],
        input=rendered,
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, applied.stderr
    assert "deployment.apps/ibckpt-operator created (server dry run)" in applied.stdout
    assert "daemonset.apps/ibckpt-agent created (server dry run)" in applied.stdout


def test_values_are_checked_against_the_schema() -> None:
    typo = template("--set", "operator.replicaz=2", check=False)
    assert typo.returncode != 0 and "Additional property replicaz is not allowed" in typo.stderr, typo.stderr
    wrong = template("--set", "agent.stopTimeoutSeconds=soon", check=False)
    assert wrong.returncode != 0 and "agent.stopTimeoutSeconds" in wrong.stderr, wrong.stderr


def test_a_service_monitor_per_component_only_when_asked() -> None:
    def monitors(*args: str) -> list[dict[str, Any]]:
        objects = yaml.safe_load_all(template(*args).stdout)
        return [d for d in objects if d and d["kind"] == "ServiceMonitor"]

    assert monitors() == []
    on = ("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.release=p")
    found = monitors(*on)
    assert sorted(m["metadata"]["name"] for m in found) == ["ibckpt-agent", "ibckpt-operator"]
    for monitor in found:
        assert monitor["metadata"]["labels"]["release"] == "p"
        assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s"}]


def test_the_agent_sets_up_its_node_and_the_runtime_class_selects_its_label() -> None:
    def rendered(*args: str) -> dict[tuple[str, str], dict[str, Any]]:
        objects = [d for d in yaml.safe_load_all(template(*args).stdout) if d]
        return {(d["kind"], d["metadata"]["name"]): d for d in objects}

    objects = rendered("--set", "agent.nextRuntime=/usr/bin/nvidia-container-runtime")
    assert objects[("RuntimeClass", "ibckpt")]["scheduling"] == {
        "nodeSelector": {"ibckpt.io/runtime-ready": "true"}
    }
    agent = objects[("DaemonSet", "ibckpt-agent")]["spec"]["template"]["spec"]
    container = agent["containers"][0]
    assert "--next-runtime=/usr/bin/nvidia-container-runtime" in container["args"]
    assert {"--node-setup", "--manage-runtime", "--runtime-restart=auto"} <= set(container["args"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # TLS only: the kubelet probes over HTTPS
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # a slow first start is not killed: liveness counts once the startup probe passed, which waits
    # as long as the agent waits for its certificate
    startup = container["startupProbe"]
    assert startup["httpGet"]["scheme"] == "HTTPS"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert "initialDelaySeconds" not in container["livenessProbe"]
    assert {"name": "IBCKPT_AGENT_DAEMONSET", "value": "ibckpt-agent"} in container["env"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["containerd-etc"]["mountPath"] == "/host/etc/containerd"
    assert mounts["containerd-tasks"]["readOnly"] is True
    operator_rules = objects[("ClusterRole", "ibckpt-operator")]["rules"]
    # recovery: nodes read only; its RestoreJob created, and deleted past the deadline
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]} in operator_rules
    assert {"apiGroups": ["ibckpt.io"], "resources": ["restorejobs"], "verbs": ["create", "delete"]} in (
        operator_rules
    )
    rules = objects[("ClusterRole", "ibckpt-agent")]["rules"]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in rules
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]} in rules
    assert objects[("Role", "ibckpt-agent")]["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["daemonsets"],
            "resourceNames": ["ibckpt-agent"],
            "verbs": ["get"],
        }
    ]
    job = objects[("Job", "ibckpt-uninstall")]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "uninstall-release"

    unmanaged = rendered("--set", "agent.manageRuntime=false", "--set", "agent.uninstallHook=false")
    args = unmanaged[("DaemonSet", "ibckpt-agent")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-manage-runtime" in args
    assert ("Job", "ibckpt-uninstall") not in unmanaged
    assert template("--set", "agent.containerd.restart=sometimes", check=False).returncode != 0


def rendered_objects(*args: str) -> dict[tuple[str, str], dict[str, Any]]:
    objects = [d for d in yaml.safe_load_all(template(*args).stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in objects}


def test_the_agents_land_on_accelerator_nodes_and_resolve_cluster_names() -> None:
    default = rendered_objects()[("DaemonSet", "ibckpt-agent")]["spec"]["template"]["spec"]
    assert default["hostNetwork"] is True and default["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "tolerations" not in default
    label_rule = default["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert label_rule["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "ibckpt.io/rdma"
    example = rendered_objects("-f", str(ACCELERATOR_VALUES))[("DaemonSet", "ibckpt-agent")]
    spec = example["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expressions = [e for term in required["nodeSelectorTerms"] for e in term["matchExpressions"]]
    assert [e["key"] for e in expressions] == ["feature.node.kubernetes.io/pci-15b3.present"]  # replaced
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_the_agents_upload_during_the_dump_unless_told_not_to_within_a_disk_window_if_given() -> None:
    def args(*values: str) -> list[str]:
        agent = rendered_objects(*values)[("DaemonSet", "ibckpt-agent")]
        return list(agent["spec"]["template"]["spec"]["containers"][0]["args"])

    default = args()
    assert "--no-pre-upload" not in default and "--disk-window-bytes=0" in default
    assert "--no-pre-upload" in args("--set", "agent.preUpload=false")
    assert "--disk-window-bytes=4294967296" in args("--set", "agent.diskWindowBytes=4294967296")


def test_the_operator_grants_storage_secrets_by_name_unless_told_not_to() -> None:
    def grants(objects: dict[tuple[str, str], dict[str, Any]]) -> tuple[list[str], list[Any]]:
        operator = objects[("Deployment", "ibckpt-operator")]["spec"]["template"]["spec"]["containers"][0]
        role = objects[("ClusterRole", "ibckpt-operator")]
        rbac = [r for r in role["rules"] if r["apiGroups"] == ["rbac.authorization.k8s.io"]]
        return [a for a in operator["args"] if a.startswith(("--agent-account", "--grants-owner"))], rbac

    objects = rendered_objects()
    args, rules = grants(objects)
    # the grants are owned by the agents' ClusterRole, which helm uninstall deletes (and with it them)
    assert args == ["--agent-account=ibckpt-agent", "--grants-owner=ibckpt-agent"]
    assert ("ClusterRole", "ibckpt-agent") in objects
    operator = objects[("Deployment", "ibckpt-operator")]["spec"]["template"]["spec"]["containers"][0]
    assert "--release=ibckpt" in operator["args"]  # labels the Roles, for kubectl ibckpt uninstall
    assert {"resources": ["roles", "rolebindings"], "verbs": ["create"]} in [
        {k: v for k, v in r.items() if k != "apiGroups"} for r in rules
    ]
    named = [r for r in rules if r.get("resourceNames")]
    assert named == [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
                      "resourceNames": ["ibckpt-agent-storage"], "verbs": ["get", "update"]},
                     {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                      "resourceNames": ["ibckpt-agent"], "verbs": ["get"]}]  # fmt: skip
    off = rendered_objects("--set", "storage.grantSecrets=false", "--set", "storage.credentialsSecret=s3")
    assert grants(off) == ([], [])
    legacy = off[("ClusterRole", "ibckpt-agent-storage")]["rules"]
    assert legacy == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["s3"], "verbs": ["get"]}
    ]


def test_the_admission_server_binds_the_pod_ip_and_a_network_policy_guards_the_operator() -> None:
    """Off by default; on, it lets the nodes reach the coordinator and liveness ports, the apiserver
    the webhook, and the given peers the metrics; it refuses to render without the addresses."""
    env = {e["name"]: e for e in _operator_env()}
    assert env["IBCKPT_WEBHOOK_BIND"]["value"] == "$(POD_IP)"  # never every address
    assert env["IBCKPT_WEBHOOK_MAX_CONNECTIONS"]["value"] == "32"
    assert "IBCKPT_WEBHOOK_CLIENT_CA" not in env
    assert not [k for k in rendered_objects() if k[0] == "NetworkPolicy"]
    with_ca = {e["name"]: e for e in _operator_env("--set", "operator.webhook.clientCA.secretName=api-ca")}
    assert with_ca["IBCKPT_WEBHOOK_CLIENT_CA"]["value"] == "/etc/ibckpt/webhook-client-ca/ca.crt"
    refused = template("--set", "networkPolicy.enabled=true", check=False)
    assert refused.returncode != 0 and "networkPolicy.nodeCIDRs" in refused.stderr
    objects = rendered_objects(
        "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.nodeCIDRs={10.0.0.0/24,fd00::/64}",
        "--set", "networkPolicy.apiserverCIDRs={10.0.0.1/32}",
    )  # fmt: skip
    (policy,) = [o for k, o in objects.items() if k[0] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    nodes, apiserver = policy["spec"]["ingress"]  # no metrics rule: nobody was named
    assert [p["ipBlock"]["cidr"] for p in nodes["from"]] == ["10.0.0.0/24", "fd00::/64"]
    assert {p["port"] for p in nodes["ports"]} == {7070, 8080}
    assert [p["ipBlock"]["cidr"] for p in apiserver["from"]] == ["10.0.0.1/32"]
    assert [p["port"] for p in apiserver["ports"]] == [9443]


def _operator_env(*args: str) -> list[dict[str, Any]]:
    (deployment,) = [o for k, o in rendered_objects(*args).items() if k[0] == "Deployment"]
    env: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return env


def test_the_operator_keeps_its_webhook_certificate_in_one_secret_it_alone_may_rewrite() -> None:
    env = {e["name"]: e.get("value") for e in _operator_env()}
    assert env["IBCKPT_WEBHOOK_SECRET"] == "ibckpt-webhook-cert"
    assert env["IBCKPT_WEBHOOK_SECRET_OWNER"] == "ibckpt-operator"  # the Deployment: its owner
    role = rendered_objects()[("Role", "ibckpt-operator")]
    secrets = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    kept = ["ibckpt-internal-tls", "ibckpt-agent-tls"]  # the release's CA, the agents' certificate
    assert secrets == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [*kept, "ibckpt-webhook-cert"],
         "verbs": ["get", "update"]},
    ]  # fmt: skip
    off = rendered_objects("--set", "operator.webhook.enabled=false")[("Role", "ibckpt-operator")]
    assert [r.get("resourceNames") for r in off["rules"] if r["resources"] == ["secrets"]] == [None, kept]


def test_the_image_keys_are_made_once_mounted_into_agents_and_operator_and_granted_to_no_one() -> None:
    objects = rendered_objects("--namespace", "ibckpt-system")
    secret = objects[("Secret", "ibckpt-image-keys")]
    assert secret["metadata"]["namespace"] == "ibckpt-system"  # the release's, not a tenant's
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # old checkpoints restore
    ((key_id, key),) = secret["data"].items()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", key_id) and len(base64.b64decode(key)) >= 32
    for kind, name, mode in (("DaemonSet", "ibckpt-agent", 0o400), ("Deployment", "ibckpt-operator", 0o440)):
        spec = objects[(kind, name)]["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "image-keys"]
        assert volume["secret"] == {"secretName": "ibckpt-image-keys", "defaultMode": mode}, kind
        container = spec["containers"][0]
        mount = {"name": "image-keys", "mountPath": "/etc/ibckpt/image-keys", "readOnly": True}
        assert (
            mount in container["volumeMounts"] and "--image-keys=/etc/ibckpt/image-keys" in container["args"]
        )
    operator = objects[("Deployment", "ibckpt-operator")]["spec"]["template"]["spec"]
    assert operator["securityContext"]["fsGroup"] == operator["securityContext"]["runAsUser"] == 65532
    # Through the API only the operator (which holds them anyway) may read it; the agents read their mount,
    # and the tenants' roles grant no Secret at all.
    readers = set()
    for (kind, name), role in objects.items():
        for rule in role.get("rules", []) if kind in ("Role", "ClusterRole") else []:
            reads = "secrets" in rule.get("resources", []) and set(rule["verbs"]) & {"get", "list", "watch"}
            if reads and "ibckpt-image-keys" in rule.get("resourceNames", ["ibckpt-image-keys"]):
                readers.add(name)
    assert readers == {"ibckpt-operator"}
    for tenant_role in ("ibckpt-edit", "ibckpt-view"):
        rules = objects[("ClusterRole", tenant_role)]["rules"]
        assert not [r for r in rules if "secrets" in r.get("resources", [])], tenant_role
    # An admin's own Secret instead: the chart makes none and mounts that one.
    own = rendered_objects("--set", "imageKeys.secretName=site-image-keys")
    assert ("Secret", "ibckpt-image-keys") not in own
    spec = own[("DaemonSet", "ibckpt-agent")]["spec"]["template"]["spec"]
    assert {"secretName": "site-image-keys", "defaultMode": 0o400} in [
        v.get("secret") for v in spec["volumes"]
    ]


def test_an_upgrade_rolls_the_operator_without_a_clash_on_its_host_port() -> None:
    """A new operator pod starts as a standby before the old one goes; with the webhook on a hostPort
    the new one could never start on the old one's node, so the old one goes first."""

    def rolling(*args: str) -> dict[str, int]:
        found = rendered_objects(*args)[("Deployment", "ibckpt-operator")]["spec"]["strategy"]
        assert found["type"] == "RollingUpdate", found
        return dict(found["rollingUpdate"])

    assert rolling() == {"maxSurge": 1, "maxUnavailable": 0}
    assert rolling("--set", "operator.webhook.hostPort=true") == {"maxSurge": 0, "maxUnavailable": 1}


def test_the_agents_serve_tls_from_the_operators_secret_and_get_tokens_bound_to_their_node() -> None:
    objects = rendered_objects()
    agent = objects[("DaemonSet", "ibckpt-agent")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in agent["volumes"]}
    # optional: the agent starts before the operator has written it, and waits for its files
    assert volumes["agent-tls"]["secret"] == {
        "secretName": "ibckpt-agent-tls",
        "defaultMode": 0o400,
        "optional": True,
    }
    container = agent["containers"][0]
    assert {"name": "agent-tls", "mountPath": "/etc/ibckpt/agent-tls", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert "--tls-dir=/etc/ibckpt/agent-tls" in container["args"]
    deployment = objects[("Deployment", "ibckpt-operator")]["spec"]["template"]["spec"]
    args = deployment["containers"][0]["args"]
    wanted = {"--tls-ca-secret=ibckpt-internal-tls", "--agent-tls-secret=ibckpt-agent-tls",
              "--tls-secret-owner=ibckpt-operator", "--operator-account=ibckpt-operator"}  # fmt: skip
    assert wanted <= set(args)
    # no long-lived token for every agent any more: the operator requests one per node
    assert not [v for v in deployment["volumes"] if "projected" in v]
    assert not [a for a in args if a.startswith("--agent-token-file")]
    role = objects[("Role", "ibckpt-operator")]
    tokens = [r for r in role["rules"] if r["resources"] == ["serviceaccounts/token"]]
    assert tokens == [{"apiGroups": [""], "resources": ["serviceaccounts/token"],
                       "resourceNames": [deployment["serviceAccountName"]], "verbs": ["create"]}]  # fmt: skip


def test_the_operator_may_be_left_no_tenant_secret_of_its_own() -> None:
    """storage.operatorSecretAccess: cluster (default) gives the operator `get` on Secrets everywhere;
    granted gives it none outside its namespace (each namespace's admin grants names: grant-storage)."""

    def cluster_wide_secret_rules(*args: str) -> list[Any]:
        role = rendered_objects(*args)[("ClusterRole", "ibckpt-operator")]
        return [r for r in role["rules"] if "secrets" in r["resources"]]

    assert cluster_wide_secret_rules() == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    assert cluster_wide_secret_rules("--set", "storage.operatorSecretAccess=granted") == []
