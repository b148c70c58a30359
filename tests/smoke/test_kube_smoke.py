"""The real kube-apiserver: our CRDs apply, validate, default, and can be watched."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from testbed.kube import establish_crds

pytestmark = pytest.mark.kube

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
GROUP, VERSION = "ibckpt.io", "v1alpha1"


def apply_crds(api: kubernetes.client.ApiClient) -> None:
    establish_crds(api, [yaml.safe_load(path.read_text()) for path in sorted(CRD_DIR.glob("*.yaml"))])


def checkpoint_job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": "ring"}},
            "storage": {"bucket": "ckpts", "credentialsSecretRef": {"name": "s3"}},
            **spec,
        },
    }


def test_crds_apply_validate_default_and_watch(kube_api: kubernetes.client.ApiClient) -> None:
    apply_crds(kube_api)
    custom = kubernetes.client.CustomObjectsApi(kube_api)
    ns = "smoke"
    kubernetes.client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": ns}})

    seen: list[tuple[str, str]] = []
    watching = threading.Event()

    def watch() -> None:
        w = kubernetes.watch.Watch()
        watching.set()
        for event in w.stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, ns, "checkpointjobs", timeout_seconds=20
        ):
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            if len(seen) >= 2:
                w.stop()

    watcher = threading.Thread(target=watch)
    watcher.start()
    watching.wait(5)
    time.sleep(0.5)

    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, ns, "checkpointjobs", checkpoint_job("ckj-a")
    )
    # Structural schema defaulting happened on the server.
    assert created["spec"]["mode"] == "LeaveRunning"
    assert created["spec"]["timeouts"]["quiesceSeconds"] == 30
    assert created["spec"]["storage"]["prefix"] == "ibckpt"

    # The status subresource is separate from spec.
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, "checkpointjobs", "ckj-a", {"status": {"phase": "Quiescing", "podCount": 2}}
    )
    got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, "checkpointjobs", "ckj-a")
    assert got["status"] == {"phase": "Quiescing", "podCount": 2}

    watcher.join(25)
    assert ("ADDED", "ckj-a") in seen
    assert ("MODIFIED", "ckj-a") in seen


def test_crd_validation_rejects_bad_spec(kube_api: kubernetes.client.ApiClient) -> None:
    apply_crds(kube_api)
    custom = kubernetes.client.CustomObjectsApi(kube_api)
    bad = checkpoint_job("ckj-bad", mode="Sometimes")
    with pytest.raises(kubernetes.client.ApiException) as info:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", "checkpointjobs", bad)
    assert info.value.status == 422
    assert "spec.mode" in info.value.body
    missing_storage = checkpoint_job("ckj-nostore")
    del missing_storage["spec"]["storage"]
    with pytest.raises(kubernetes.client.ApiException) as info:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", "checkpointjobs", missing_storage)
    assert info.value.status == 422
    assert "spec.storage" in info.value.body


def test_rbac_is_enforced(kube_api: kubernetes.client.ApiClient, kube) -> None:  # type: ignore[no-untyped-def]
    """A token without bindings is authenticated but forbidden: RBAC is really on."""
    core = kubernetes.client.CoreV1Api(kube_api)
    core.create_namespaced_service_account("default", {"metadata": {"name": "nobody"}})
    deadline = time.monotonic() + 30
    while True:  # the controller-manager's token controller fills in the token secret
        sa = core.read_namespaced_service_account("nobody", "default")
        if sa.secrets:
            break
        assert time.monotonic() < deadline, "serviceaccount token never issued (controller-manager down?)"
        time.sleep(0.3)
    import base64

    secret = core.read_namespaced_secret(sa.secrets[0].name, "default")
    token = base64.b64decode(secret.data["token"]).decode()
    cfg = kubernetes.client.Configuration()
    cfg.host = kube.url
    cfg.ssl_ca_cert = str(kube.ca_file)
    cfg.api_key = {"authorization": f"Bearer {token}"}
    with kubernetes.client.ApiClient(cfg) as limited:
        with pytest.raises(kubernetes.client.ApiException) as info:
            kubernetes.client.CoreV1Api(limited).list_namespaced_pod("default")
        assert info.value.status == 403
