"""The Helm chart lints, renders, and every object it renders is accepted by the real apiserver."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes
import pytest
import yaml

from testbed.guest import cache_dir

pytestmark = pytest.mark.kube

CHART = Path(__file__).resolve().parents[2] / "charts" / "ibckpt"


def tool(name: str) -> str:
    path = cache_dir() / "helm" / name
    assert path.exists(), f"{path} missing: run tests/testbed/fetch-helm.sh (make helm)"
    return str(path)


def test_chart_lints_strict() -> None:
    out = subprocess.run([tool("helm"), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_chart_passes_server_dry_run(kube, kube_api: kubernetes.client.ApiClient) -> None:  # type: ignore[no-untyped-def]
    # Its own namespace: the operator tests share this apiserver and create ibckpt-system themselves.
    namespace = "ibckpt-smoke"
    kubernetes.client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": namespace}})
    rendered = subprocess.run(
        [tool("helm"), "template", "ibckpt", str(CHART), "--namespace", namespace, "--include-crds"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(rendered) if d)
    assert kinds.count("CustomResourceDefinition") == 5
    assert {"Deployment", "DaemonSet", "ClusterRole", "ServiceAccount"} <= set(kinds)
    applied = subprocess.run(
        [tool("kubectl"), f"--kubeconfig={kube.kubeconfig}", "apply", "--dry-run=server", "-f", "-"],
        input=rendered,
        capture_output=True,
        text=True,
    )
    assert applied.returncode == 0, applied.stderr
    assert "deployment.apps/ibckpt-operator created (server dry run)" in applied.stdout
    assert "daemonset.apps/ibckpt-agent created (server dry run)" in applied.stdout
