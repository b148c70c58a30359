"""`storage.operatorSecretAccess: granted`: the operator reads no tenant's Secret until that namespace's
admin grants the ones its storage names (`kubectl ibckpt grant-storage`), on the real apiserver with the
chart's RBAC for the operator's account (impersonated), and the plugin run as the admin."""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import Iterator

import kubernetes
import pytest

from ibckpt.api import S3Location
from ibckpt_operator.cluster import storage
from ibckpt_operator.cluster.kube import Kube
from testbed import operator_account as chart_rbac
from testbed.cluster import kubectl_ibckpt
from testbed.kube import ControlPlane

pytestmark = pytest.mark.kube


@pytest.fixture
def granted_operator(kube_api: kubernetes.client.ApiClient) -> Iterator[tuple[Kube, str]]:
    """The operator's client under the chart's RBAC with granted Secret access; its account's name."""
    for kube, _secret, deployment in chart_rbac.operator_account(
        kube_api, "storage.operatorSecretAccess=granted"
    ):
        yield kube, deployment  # the operator's account is named like its Deployment


def _team(kube_api: kubernetes.client.ApiClient) -> str:
    name = "team-" + secrets.token_hex(3)
    core = kubernetes.client.CoreV1Api(kube_api)
    core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in
               {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key"}.items()}  # fmt: skip
    for secret in ("s3-creds", "sealing", "unrelated"):
        data = encoded if secret != "sealing" else {"IBCKPT_ENCRYPTION_KEY": base64.b64encode(
            base64.b64encode(bytes(32))).decode()}  # fmt: skip
        core.create_namespaced_secret(name, {"metadata": {"name": secret}, "data": data})  # type: ignore[arg-type]
    storage_spec = {
        "endpoint": "http://127.0.0.1:1",
        "bucket": "ckpts",
        "credentialsSecretRef": {"name": "s3-creds"},
        "encryption": {"mode": "client", "keySecretRef": {"name": "sealing"}},
    }
    kubernetes.client.CustomObjectsApi(kube_api).create_namespaced_custom_object(
        "ibckpt.io", "v1alpha1", name, "checkpointstorages",
        {"apiVersion": "ibckpt.io/v1alpha1", "kind": "CheckpointStorage", "metadata": {"name": "store"},
         "spec": storage_spec},
    )  # fmt: skip
    return name


def test_the_operator_reads_only_the_secrets_a_namespace_granted(
    kube: ControlPlane,
    kube_api: kubernetes.client.ApiClient,
    crds: object,
    granted_operator: tuple[Kube, str],
) -> None:
    operator, account = granted_operator
    ns = _team(kube_api)
    spec = kubernetes.client.CustomObjectsApi(kube_api).get_namespaced_custom_object(
        "ibckpt.io", "v1alpha1", ns, "checkpointstorages", "store"
    )["spec"]
    location = S3Location.model_validate(spec)
    with pytest.raises(storage.StorageProblem) as refused:
        asyncio.run(storage.resolve(operator, ns, location))
    assert refused.value.reason == "SecretNotGranted"
    assert f"may not read the credentials Secret {ns}/s3-creds" in refused.value.message
    assert "kubectl ibckpt grant-storage STORAGE" in refused.value.message

    # the namespace's admin (here the cluster's) grants them, by name
    granted = kubectl_ibckpt(
        kube.kubeconfig, ns, "grant-storage", "store",
        "--operator-namespace", chart_rbac.OPERATOR_ACCOUNT_NS, "--operator-account", account,
    )  # fmt: skip
    assert granted.returncode == 0, granted.stdout + granted.stderr
    assert granted.stdout.strip().endswith("may get secrets s3-creds, sealing"), granted.stdout
    for _ in range(50):  # the authorizer may see a new Role a moment later
        try:
            resolved = asyncio.run(storage.resolve(operator, ns, location))
            break
        except storage.StorageProblem:
            asyncio.run(asyncio.sleep(0.1))
    assert resolved.config.encryption.mode == "client" and resolved.config.encryption.client_key is not None
    # nothing unnamed: another Secret of the namespace stays out of the operator's reach
    with pytest.raises(kubernetes.client.ApiException) as other:
        asyncio.run(operator.get_secret(ns, "unrelated"))
    assert other.value.status == 403
