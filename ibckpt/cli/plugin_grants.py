"""`kubectl ibckpt grant-storage STORAGE`: let the operator read a CheckpointStorage's Secrets, by name.

With the chart's `storage.operatorSecretAccess: granted` the operator may read no tenant's Secret of its
own: a namespace's admin grants it the ones its storages name (credentials, CA bundle, client-side
encryption key) with a Role `ibckpt-operator-storage` (get, by name) and a RoleBinding to the operator's
account. Names are only added, as a second storage's may be in use. RBAC's escalation check applies: only
someone who may read those Secrets can grant them (docs/helm.md, "Storage Secrets")."""

from __future__ import annotations

import argparse
from typing import Any

from ibckpt.api import CHECKPOINT_STORAGE
from ibckpt.cli.kubeapi import Body, KubeApi, PluginError

ROLE = "ibckpt-operator-storage"
LABELS = {"app.kubernetes.io/managed-by": "kubectl-ibckpt"}


def secret_names(spec: Body) -> list[str]:
    """The Secrets a CheckpointStorage's spec names."""
    refs = [spec.get("credentialsSecretRef"), spec.get("caBundleSecretRef")]
    refs.append((spec.get("encryption") or {}).get("keySecretRef"))
    return sorted({str(ref["name"]) for ref in refs if ref and ref.get("name")})


def _granted(role: Any) -> set[str]:
    return {name for rule in role.rules or () for name in rule.resource_names or ()}


def grant_storage(api: KubeApi, args: argparse.Namespace) -> int:
    import kubernetes

    storage = api.must_get(CHECKPOINT_STORAGE, args.storage)
    wanted = set(secret_names(storage.get("spec") or {}))
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(api.client)
    ns = api.namespace
    try:
        try:
            existing = rbac.read_namespaced_role(ROLE, ns)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            existing = None
        names = sorted(wanted | (_granted(existing) if existing is not None else set()))
        rule: Body = {"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get"]}
        role: Body = {"metadata": {"name": ROLE, "labels": LABELS}, "rules": [rule]}
        if existing is None:
            rbac.create_namespaced_role(ns, role)
        else:
            rbac.replace_namespaced_role(ROLE, ns, {**role, "metadata": {**role["metadata"],
                                         "resourceVersion": existing.metadata.resource_version}})  # fmt: skip
        subject = {
            "kind": "ServiceAccount",
            "name": args.operator_account,
            "namespace": args.operator_namespace,
        }
        binding: Body = {
            "metadata": {"name": ROLE, "labels": LABELS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
            "subjects": [subject],
        }
        try:
            rbac.create_namespaced_role_binding(ns, binding)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            rbac.replace_namespaced_role_binding(ROLE, ns, binding)
    except kubernetes.client.ApiException as exc:
        raise PluginError(
            f"granting the operator the Secrets of {args.storage}: {exc.status} {exc.reason}"
        ) from None
    print(
        f"role/{ROLE}: {args.operator_namespace}/{args.operator_account} may get secrets {', '.join(names)}"
    )
    return 0


def add_parser(commands: Any) -> None:
    g = commands.add_parser("grant-storage", help="let the operator read a CheckpointStorage's Secrets")
    g.add_argument("storage", help="the CheckpointStorage")
    g.add_argument("--operator-namespace", default="ibckpt-system", help="where the chart runs the operator")
    g.add_argument("--operator-account", default="ibckpt-operator", help="the operator's ServiceAccount")
    g.set_defaults(run=grant_storage)
