"""The chart's RBAC for a fresh release on the test apiserver, and a client acting as its operator's
account: what tests/operator checks the operator's Secrets against (fixture `operator_account`)."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator

import kubernetes
import yaml
from kubernetes.client import ApiException

from ibckpt_operator.cluster.kube import Kube
from testbed.guest import REPO, cache_dir

OPERATOR_ACCOUNT_NS = "webhook-cert-system"


def _helm(*args: str) -> str:
    path = cache_dir() / "helm" / "helm"
    assert path.exists(), f"{path} missing: run tests/testbed/fetch-helm.sh (make helm)"
    done = subprocess.run([str(path), *args], capture_output=True, text=True, check=True)
    return done.stdout


def operator_account(kube_api: kubernetes.client.ApiClient, *values: str) -> Iterator[tuple[Kube, str, str]]:
    """The chart's RBAC for a fresh release applied (with `values`: helm's --set terms); a Kube client
    impersonating its operator's account, the Secret's name, the Deployment's name."""
    release = "wh" + secrets.token_hex(3)
    core = kubernetes.client.CoreV1Api(kube_api)
    try:
        core.create_namespace({"metadata": {"name": OPERATOR_ACCOUNT_NS}})  # type: ignore[arg-type]
    except ApiException as exc:
        if exc.status != 409:
            raise
    sets = [arg for value in values for arg in ("--set", value)]
    rendered = _helm("template", release, str(REPO / "charts" / "ibckpt"), "-n", OPERATOR_ACCOUNT_NS,
                     "--show-only", "templates/rbac.yaml", *sets)  # fmt: skip
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    for body in objects:
        kubernetes.utils.create_from_dict(kube_api, body, namespace=OPERATOR_ACCOUNT_NS)  # type: ignore[no-untyped-call]
    pod = {"metadata": {"labels": {"app": release}}, "spec": {"containers": [{"name": "x", "image": "none"}]}}
    deployment = {"metadata": {"name": f"{release}-ibckpt-operator"},
                  "spec": {"selector": {"matchLabels": {"app": release}}, "template": pod}}  # fmt: skip
    apps = kubernetes.client.AppsV1Api(kube_api)
    apps.create_namespaced_deployment(OPERATOR_ACCOUNT_NS, deployment)  # type: ignore[arg-type]
    impersonated = kubernetes.client.ApiClient(kube_api.configuration)
    user = f"system:serviceaccount:{OPERATOR_ACCOUNT_NS}:{release}-ibckpt-operator"
    impersonated.set_default_header("Impersonate-User", user)  # type: ignore[no-untyped-call]
    impersonated.set_default_header("Impersonate-Group", "system:serviceaccounts")  # type: ignore[no-untyped-call]
    yield Kube(impersonated), f"{release}-ibckpt-webhook-cert", f"{release}-ibckpt-operator"
