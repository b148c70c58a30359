"""The agents may read a storage's Secrets by name in its namespace and nothing else (cluster/
secretgrants.py), checked on the real apiserver with SubjectAccessReviews for the agents' account."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from ibckpt.api import S3Location
from ibckpt_operator import config as settings
from ibckpt_operator.cluster import secretgrants
from ibckpt_operator.cluster.kube import Kube
from ibckpt_operator.machine import secretgrants as rules

pytestmark = pytest.mark.kube
AGENT = "ibckpt-agent"
AGENT_NS = "ibckpt-system"


def location(secret: str, ca: str | None = None) -> S3Location:
    wire: dict[str, Any] = {"bucket": "ckpts", "credentialsSecretRef": {"name": secret}}
    if ca:
        wire["caBundleSecretRef"] = {"name": ca, "key": "ca.pem"}
    return S3Location.model_validate(wire)


@pytest.fixture
def agent_account() -> Iterator[None]:
    saved = settings.current()
    settings.configure(saved.with_(agent_account=AGENT, namespace=AGENT_NS))
    yield
    settings.configure(saved)


def may_get(api: kubernetes.client.ApiClient, namespace: str, secret: str) -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{AGENT_NS}:{AGENT}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{AGENT_NS}"],
            "resourceAttributes": {
                "namespace": namespace,
                "verb": "get",
                "resource": "secrets",
                "name": secret,
            },
        },
    }
    answer = kubernetes.client.AuthorizationV1Api(api).create_subject_access_review(review)
    return bool(answer.status.allowed)


def namespace(api: kubernetes.client.ApiClient, name: str) -> str:
    try:
        kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    return name


def test_the_agents_may_read_exactly_the_named_secrets_of_the_storages_namespace(
    kube_api: kubernetes.client.ApiClient, agent_account: None
) -> None:
    team_a, team_b = namespace(kube_api, "grants-a"), namespace(kube_api, "grants-b")
    kube = Kube(kube_api)

    async def grant(ns: str, where: S3Location) -> None:
        await secretgrants.grant(kube, ns, where)

    assert not may_get(kube_api, team_a, "team-a-s3")
    asyncio.run(grant(team_a, location("team-a-s3")))
    asyncio.run(grant(team_a, location("team-a-s3")))  # again: nothing to change
    asyncio.run(grant(team_a, location("other-s3", ca="minio-ca")))  # a second storage adds its names
    asyncio.run(grant(team_b, location("team-b-s3")))
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube_api)
    role = rbac.read_namespaced_role(rules.grant_name(AGENT), team_a)
    assert role.rules[0].resource_names == ["minio-ca", "other-s3", "team-a-s3"]
    assert role.rules[0].verbs == ["get"]
    assert role.metadata.labels == rules.MANAGED_BY
    # the authorizer may see a new Role a moment later, as the agents' reader allows for
    for _ in range(50):
        if may_get(kube_api, team_a, "team-a-s3") and may_get(kube_api, team_b, "team-b-s3"):
            break
        asyncio.run(asyncio.sleep(0.1))
    for secret in ("team-a-s3", "other-s3", "minio-ca"):
        assert may_get(kube_api, team_a, secret), secret
    assert may_get(kube_api, team_b, "team-b-s3")
    # nothing unnamed, nothing of another namespace under a name granted elsewhere
    assert not may_get(kube_api, team_a, "team-b-s3")
    assert not may_get(kube_api, team_b, "team-a-s3")
    assert not may_get(kube_api, "default", "team-a-s3")
    assert not may_get(kube_api, team_a, "unrelated")


def test_the_grants_carry_the_release_label_even_when_made_by_an_older_operator(
    kube_api: kubernetes.client.ApiClient, agent_account: None
) -> None:
    """`kubectl ibckpt uninstall` finds them by label: one made before the release label gains it."""
    ns = namespace(kube_api, "grants-labels")
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube_api)
    name = rules.grant_name(AGENT)
    old_role = rules.role(ns, name, {"s3"})  # as an operator without --release made them
    old_role["metadata"]["labels"] = {}
    rbac.create_namespaced_role(ns, old_role)
    old_binding = rules.binding(ns, name, AGENT, AGENT_NS)
    old_binding["metadata"]["labels"] = {}
    rbac.create_namespaced_role_binding(ns, old_binding)
    settings.configure(settings.current().with_(release="rel-a"))
    asyncio.run(secretgrants.grant(Kube(kube_api), ns, location("s3")))  # no new name, only labels
    wanted = {**rules.MANAGED_BY, "app.kubernetes.io/instance": "rel-a"}
    assert rbac.read_namespaced_role(name, ns).metadata.labels == wanted
    assert rbac.read_namespaced_role_binding(name, ns).metadata.labels == wanted
    selector = "app.kubernetes.io/managed-by=ibckpt-operator,app.kubernetes.io/instance=rel-a"
    found = rbac.list_role_for_all_namespaces(label_selector=selector).items
    assert [r.metadata.name for r in found] == [name]


def test_without_an_agent_account_nothing_is_granted(kube_api: kubernetes.client.ApiClient) -> None:
    ns = namespace(kube_api, "grants-none")
    saved = settings.current()
    settings.configure(saved.with_(agent_account=""))
    try:
        asyncio.run(secretgrants.grant(Kube(kube_api), ns, location("s3")))
    finally:
        settings.configure(saved)
    roles = kubernetes.client.RbacAuthorizationV1Api(kube_api).list_namespaced_role(ns)
    assert roles.items == []


def test_the_objects_name_only_the_locations_secrets() -> None:
    assert rules.agent_secrets(location("s3", ca="ca")) == ["ca", "s3"]
    assert rules.agent_secrets(location("s3", ca="s3")) == ["s3"]
    body = rules.role("ns", "r", {"b", "a"})
    assert rules.granted(body) == {"a", "b"}
    assert body["rules"][0]["resourceNames"] == ["a", "b"]
    assert rules.granted(None) == set()
    assert not rules.relabel(body, "") and rules.relabel(body, "rel-a")
    assert not rules.relabel(rules.role("ns", "r", {"a"}, "rel-a"), "rel-a")
    bound = rules.binding("ns", "r", "agent", "sys")
    assert bound["subjects"] == [{"kind": "ServiceAccount", "name": "agent", "namespace": "sys"}]
    assert bound["roleRef"] == {"apiGroup": rules.RBAC, "kind": "Role", "name": "r"}


def test_the_grants_go_with_the_agents_cluster_role(
    kube_api: kubernetes.client.ApiClient, agent_account: None
) -> None:
    """`helm uninstall` deletes the agents' ClusterRole: the garbage collector then removes every
    namespace's grant, which Helm does not know. A grant made before the owner was known gains it."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube_api)
    owner = "grants-owner-agent"
    made = rbac.create_cluster_role({"metadata": {"name": owner}, "rules": []})
    older, newer = namespace(kube_api, "grants-gc-a"), namespace(kube_api, "grants-gc-b")
    name = rules.grant_name(AGENT)
    asyncio.run(secretgrants.grant(Kube(kube_api), older, location("s3")))  # no owner configured yet
    assert not rbac.read_namespaced_role(name, older).metadata.owner_references
    settings.configure(settings.current().with_(grants_owner=owner))
    for ns in (older, newer):
        asyncio.run(secretgrants.grant(Kube(kube_api), ns, location("s3")))
        for found in (rbac.read_namespaced_role(name, ns), rbac.read_namespaced_role_binding(name, ns)):
            [ref] = found.metadata.owner_references
            assert (ref.kind, ref.name, ref.uid) == ("ClusterRole", owner, made.metadata.uid), found.metadata

    rbac.delete_cluster_role(owner)
    for _ in range(300):
        left = [
            (ns, kind)
            for ns in (older, newer)
            for kind, listed in (
                ("Role", rbac.list_namespaced_role(ns)),
                ("RoleBinding", rbac.list_namespaced_role_binding(ns)),
            )
            if any(item.metadata.name == name for item in listed.items)
        ]
        if not left:
            break
        asyncio.run(asyncio.sleep(0.2))
    assert not left, f"still there after the owner went: {left}"


def test_a_missing_owner_leaves_the_grants_unowned_but_made(
    kube_api: kubernetes.client.ApiClient, agent_account: None
) -> None:
    settings.configure(settings.current().with_(grants_owner="no-such-cluster-role"))
    ns = namespace(kube_api, "grants-no-owner")
    asyncio.run(secretgrants.grant(Kube(kube_api), ns, location("s3")))
    role = kubernetes.client.RbacAuthorizationV1Api(kube_api).read_namespaced_role(
        rules.grant_name(AGENT), ns
    )
    assert role.rules[0].resource_names == ["s3"] and not role.metadata.owner_references


def test_a_client_side_keys_secret_is_granted_with_the_credentials() -> None:
    sealed = S3Location.model_validate(
        {
            "bucket": "ckpts",
            "credentialsSecretRef": {"name": "creds"},
            "encryption": {"mode": "client", "keySecretRef": {"name": "sealing", "key": "k"}},
        }
    )
    assert rules.agent_secrets(sealed) == ["creds", "sealing"]
    assert rules.agent_secrets(location("creds")) == ["creds"]
