"""The chart's user roles on the real v1.20 apiserver: whoever the built-in `edit` role is bound to in a
namespace works with ibckpt's kinds there and nowhere else, never writes their status; `view` reads them.

Only the CRDs and the chart's user-roles template are installed; identities are impersonated by the
cluster admin (`kubectl --as`). The built-in roles take the chart's rules in through the ClusterRole
aggregation controller, which the session's controller-manager does not run: this module runs it alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest
import yaml

from testbed.guest import REPO, cache_dir
from testbed.kube import ControlPlane, establish_crds, kube_bin
from testbed.reaper import die_with_parent

pytestmark = pytest.mark.kube

CHART = REPO / "charts" / "ibckpt"
TEMPLATE = "templates/user-roles.yaml"
TEAM_A, TEAM_B = "roles-team-a", "roles-team-b"
EDITOR, VIEWER, ADMIN = "alice", "bob", "carol"
KINDS = ("checkpointjobs", "restorejobs", "checkpointschedules", "checkpointstorages", "checkpoints")
AGGREGATE_WAIT_S = 30.0


def _helm_tool(name: str) -> str:
    path = cache_dir() / "helm" / name
    assert path.exists(), f"{path} missing: run tests/testbed/fetch-helm.sh (make helm)"
    return str(path)


@dataclass
class Roles:
    kube: ControlPlane
    api: kubernetes.client.ApiClient
    rendered: str

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [_helm_tool("kubectl"), f"--kubeconfig={self.kube.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc

    def may(
        self, user: str, verb: str, kind: str, namespace: str, subresource: str = "", group: str = "ibckpt.io"
    ) -> bool:
        """The apiserver's answer for an authenticated user, as `kubectl auth can-i --as=USER` asks it
        (namespace "": in every namespace); milliseconds where kubectl takes most of a second."""
        k = kubernetes.client
        attributes = k.V1ResourceAttributes(
            namespace=namespace, verb=verb, group=group, resource=kind, subresource=subresource
        )
        spec = k.V1SubjectAccessReviewSpec(
            user=user, groups=["system:authenticated"], resource_attributes=attributes
        )
        review = k.AuthorizationV1Api(self.api).create_subject_access_review(
            k.V1SubjectAccessReview(spec=spec)
        )
        assert review.status is not None
        return bool(review.status.allowed)

    def can_i(self, user: str, *args: str) -> bool:
        proc = self.kubectl("auth", "can-i", *args, f"--as={user}", check=False)
        answer = proc.stdout.strip()
        assert answer in ("yes", "no"), proc.stdout + proc.stderr
        return answer == "yes"


def _wait(what: str, done: Callable[[], bool]) -> None:
    """Aggregation is asynchronous: poll, within a bound."""
    deadline = time.monotonic() + AGGREGATE_WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"not within {AGGREGATE_WAIT_S}s: {what}"
        time.sleep(0.2)


def _builtin_roles_include_ibckpt(rbac: kubernetes.client.RbacAuthorizationV1Api, present: bool) -> bool:
    for name in ("edit", "admin", "view"):
        rules = rbac.read_cluster_role(name).rules or []
        if any("ibckpt.io" in (rule.api_groups or []) for rule in rules) != present:
            return False
    return True


def _render() -> str:
    """Only the user-roles template, as a release named ibckpt renders it; fails if it is not there."""
    proc = subprocess.run(
        [
            _helm_tool("helm"),
            "template",
            "ibckpt",
            str(CHART),
            "--namespace",
            "ibckpt-system",
            "--show-only",
            TEMPLATE,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _chart_crds() -> list[dict[str, Any]]:
    crds = [yaml.safe_load(path.read_text()) for path in sorted((CHART / "crds").glob("*.yaml"))]
    assert len(crds) == 5
    return crds


@pytest.fixture(scope="module")
def aggregation_controller(kube: ControlPlane) -> Iterator[None]:
    """The controller-manager's ClusterRole aggregation, alone, beside the session's controller-manager
    (testbed.kube's list of controllers has no clusterrole-aggregation; were it added, two would write
    the same rules, which does no harm)."""
    log = kube.workdir / "clusterrole-aggregation.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(kube_bin("kube-controller-manager")),
                f"--kubeconfig={kube.kubeconfig}",
                "--controllers=clusterrole-aggregation",
                "--leader-elect=false",
                "--port=0",
                "--secure-port=0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def roles(
    kube: ControlPlane, kube_api: kubernetes.client.ApiClient, aggregation_controller: None
) -> Iterator[Roles]:
    establish_crds(kube_api, _chart_crds())
    found = Roles(kube, kube_api, _render())
    core = kubernetes.client.CoreV1Api(kube_api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube_api)
    try:
        for namespace in (TEAM_A, TEAM_B):
            core.create_namespace(
                kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=namespace))
            )
        # Each user bound to one built-in role, in team A only, as a namespace's owner binds people.
        for user, role in ((EDITOR, "edit"), (VIEWER, "view"), (ADMIN, "admin")):
            binding = kubernetes.client.V1RoleBinding(
                metadata=kubernetes.client.V1ObjectMeta(name=f"{user}-{role}"),
                role_ref=kubernetes.client.V1RoleRef(
                    api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role
                ),
                subjects=[
                    kubernetes.client.RbacV1Subject(
                        api_group="rbac.authorization.k8s.io", kind="User", name=user
                    )
                ],
            )
            rbac.create_namespaced_role_binding(TEAM_A, binding)
        # Without the chart's roles, edit (aggregated: its built-in rules are there) grants nothing on
        # ibckpt's kinds: what users met before.
        _wait("edit aggregated", lambda: found.may(EDITOR, "create", "configmaps", TEAM_A, group=""))
        assert not found.may(EDITOR, "create", "checkpointjobs", TEAM_A)
        found.kubectl("apply", "-f", "-", stdin=found.rendered)
        _wait("edit, admin and view include ibckpt.io", lambda: _builtin_roles_include_ibckpt(rbac, True))
        yield found
    finally:
        found.kubectl("delete", "-f", "-", "--ignore-not-found", stdin=found.rendered, check=False)
        for namespace in (TEAM_A, TEAM_B):
            found.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)
        # Leave the built-in roles as the session found them.
        _wait("edit, admin and view without ibckpt.io", lambda: _builtin_roles_include_ibckpt(rbac, False))


def test_the_template_renders_namespaced_rules_only(roles: Roles) -> None:
    docs = [doc for doc in yaml.safe_load_all(roles.rendered) if doc]
    assert [(doc["kind"], doc["metadata"]["name"]) for doc in docs] == [
        ("ClusterRole", "ibckpt-edit"),
        ("ClusterRole", "ibckpt-view"),
    ]
    for doc in docs:
        for rule in doc["rules"]:
            assert rule["apiGroups"] == ["ibckpt.io"]
            assert set(rule["resources"]) <= set(KINDS), rule  # no subresource, nothing cluster-scoped
    edit, view = docs
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"


ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")
READ = ("get", "list", "watch")


def test_an_editor_works_in_her_namespace_only(roles: Roles) -> None:
    for kind in ("checkpointjobs", "restorejobs", "checkpointschedules", "checkpointstorages"):
        for verb in ALL_VERBS:
            assert roles.may(EDITOR, verb, kind, TEAM_A), (verb, kind)
            assert not roles.may(EDITOR, verb, kind, TEAM_B), (verb, kind)
            assert not roles.may(EDITOR, verb, kind, ""), (verb, kind)  # across namespaces
        # the status is the operator's
        for verb in ("update", "patch"):
            assert not roles.may(EDITOR, verb, kind, TEAM_A, "status"), (verb, kind)
    # Checkpoints are the operator's record: she reads and deletes them, never writes one.
    for verb in ALL_VERBS:
        assert roles.may(EDITOR, verb, "checkpoints", TEAM_A) == (verb in (*READ, "delete")), verb
        assert not roles.may(EDITOR, verb, "checkpoints", TEAM_B), verb
    assert not roles.may(EDITOR, "patch", "checkpoints", TEAM_A, "status")
    assert not roles.may(EDITOR, "create", "customresourcedefinitions", "", group="apiextensions.k8s.io")


def test_the_admin_role_includes_them(roles: Roles) -> None:
    assert roles.may(ADMIN, "create", "checkpointjobs", TEAM_A)
    assert roles.may(ADMIN, "update", "checkpointstorages", TEAM_A)
    assert roles.may(ADMIN, "delete", "checkpoints", TEAM_A)
    assert not roles.may(ADMIN, "create", "checkpoints", TEAM_A)
    assert not roles.may(ADMIN, "patch", "checkpointjobs", TEAM_A, "status")
    assert not roles.may(ADMIN, "create", "checkpointjobs", TEAM_B)


def test_a_viewer_reads_and_writes_nothing(roles: Roles) -> None:
    for kind in KINDS:
        for verb in ALL_VERBS:
            assert roles.may(VIEWER, verb, kind, TEAM_A) == (verb in READ), (verb, kind)
            assert not roles.may(VIEWER, verb, kind, TEAM_B), (verb, kind)
        assert not roles.may(VIEWER, "patch", kind, TEAM_A, "status"), kind


def test_kubectl_auth_can_i_says_the_same(roles: Roles) -> None:
    job = "checkpointjobs.ibckpt.io"
    assert roles.can_i(EDITOR, "create", job, "-n", TEAM_A)
    assert roles.can_i(EDITOR, "create", "restorejobs.ibckpt.io", "-n", TEAM_A)
    assert not roles.can_i(EDITOR, "create", job, "-n", TEAM_B)
    assert not roles.can_i(EDITOR, "patch", job, "--subresource=status", "-n", TEAM_A)
    assert roles.can_i(VIEWER, "list", job, "-n", TEAM_A)
    assert not roles.can_i(VIEWER, "create", job, "-n", TEAM_A)


JOB, RESTORE = "checkpointjob.ibckpt.io/ring-ckpt", "restorejob.ibckpt.io/ring-back"
OBJECTS = json.dumps(
    {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "ibckpt.io/v1alpha1",
                "kind": "CheckpointJob",
                "metadata": {"name": "ring-ckpt"},
                "spec": {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}},
            },
            {
                "apiVersion": "ibckpt.io/v1alpha1",
                "kind": "RestoreJob",
                "metadata": {"name": "ring-back"},
                "spec": {"checkpointName": "ring-1"},
            },
        ],
    }
)


def _forbidden(proc: subprocess.CompletedProcess[str], count: int = 1) -> bool:
    return proc.returncode != 0 and proc.stderr.count("forbidden") == count


def test_real_requests_as_the_users(roles: Roles) -> None:
    """Each kubectl call costs most of a second here: few calls, each checked for what it must show."""
    created = roles.kubectl("create", "-n", TEAM_A, "-f", "-", f"--as={EDITOR}", stdin=OBJECTS)
    assert created.stdout.split() == [JOB, "created", RESTORE, "created"], created.stdout
    denied = roles.kubectl("create", "-n", TEAM_B, "-f", "-", f"--as={EDITOR}", stdin=OBJECTS, check=False)
    assert _forbidden(denied, 2), denied.stderr
    denied = roles.kubectl("create", "-n", TEAM_A, "-f", "-", f"--as={VIEWER}", stdin=OBJECTS, check=False)
    assert _forbidden(denied, 2), denied.stderr

    listed = roles.kubectl("get", "checkpointjobs,restorejobs", "-n", TEAM_A, "-o", "name", f"--as={VIEWER}")
    assert listed.stdout.split() == [JOB, RESTORE]

    patch = ("patch", JOB, "-n", TEAM_A, "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": {"phase": "Quiescing"}}))  # fmt: skip
    assert _forbidden(roles.kubectl(*patch, f"--as={EDITOR}", check=False))
    roles.kubectl(*patch)  # a good request otherwise: the cluster admin (in the operator's place) makes it
    roles.kubectl("label", JOB, "-n", TEAM_A, "team=hpc", f"--as={EDITOR}")  # the spec side is hers
    assert _forbidden(roles.kubectl("delete", JOB, "-n", TEAM_A, f"--as={VIEWER}", check=False))
    roles.kubectl("delete", JOB, RESTORE, "-n", TEAM_A, f"--as={EDITOR}", "--wait=false")


def test_removing_the_roles_takes_the_rights_back(
    roles: Roles, kube_api: kubernetes.client.ApiClient
) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube_api)
    roles.kubectl("delete", "-f", "-", stdin=roles.rendered)
    _wait("edit, admin and view without ibckpt.io", lambda: _builtin_roles_include_ibckpt(rbac, False))
    assert not roles.may(EDITOR, "create", "checkpointjobs", TEAM_A)
    assert not roles.may(VIEWER, "list", "checkpointjobs", TEAM_A)
    # as they were, for any test after this one
    roles.kubectl("apply", "-f", "-", stdin=roles.rendered)
    _wait("edit, admin and view include ibckpt.io", lambda: _builtin_roles_include_ibckpt(rbac, True))
