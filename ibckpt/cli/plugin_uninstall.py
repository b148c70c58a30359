"""`kubectl ibckpt uninstall`: what `helm uninstall` leaves, removed while the operator still runs.

Refuses while a CheckpointJob or RestoreJob runs anywhere (it names them). Without `--yes` it only says
what it would do. With it: every CheckpointSchedule is deleted first (no new job starts; the
PodDisruptionBudgets it owns go too, which would otherwise block every later drain of its nodes), then
the finished jobs, then the Checkpoints (their images stay in S3 unless `--delete-images`), waiting for
the operator to release each finalizer and removing the ones it does not release in time; last the
webhook configurations `ibckpt.io` and the agents' storage Roles and RoleBindings the operator made in
job namespaces (found by their labels). Run it with a cluster administrator's kubeconfig, before
`helm uninstall` (docs/uninstall.md)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ibckpt.api import CHECKPOINT, CHECKPOINT_JOB, CHECKPOINT_SCHEDULE, GROUP, RESTORE_JOB, VERSION, KindInfo
from ibckpt.cli.kubeapi import Body, KubeApi, PluginError

# The labels of the storage Roles and RoleBindings the operator makes (machine/secretgrants.py, which the
# CLI does not import: the operator's package is not the plugin's)
GRANTS_SELECTOR = "app.kubernetes.io/managed-by=ibckpt-operator"
RELEASE_LABEL = "app.kubernetes.io/instance"
RBAC = "/apis/rbac.authorization.k8s.io/v1"
RETAIN_IMAGES = "ibckpt.io/retain-images"  # the Checkpoint finalizer leaves the images when "true"
WEBHOOK_CONFIGURATION = "ibckpt.io"
FINISHED = {"Succeeded", "Failed"}


def _running(api: KubeApi) -> list[str]:
    found = []
    for kind in (CHECKPOINT_JOB, RESTORE_JOB):
        for body in api.list(kind, all_namespaces=True):
            phase = (body.get("status") or {}).get("phase")
            if phase not in FINISHED:
                meta = body["metadata"]
                found.append(f"{kind.kind} {meta['namespace']}/{meta['name']} ({phase or 'Pending'})")
    return sorted(found)


def _objects(api: KubeApi, kind: KindInfo) -> list[tuple[str, str]]:
    found = api.list(kind, all_namespaces=True)
    return sorted((b["metadata"]["namespace"], b["metadata"]["name"]) for b in found)


def _budgets_path(api: KubeApi) -> str:
    """policy/v1 where the cluster serves it (1.21 and later), else policy/v1beta1."""
    for version in ("v1", "v1beta1"):
        if api.raw("GET", f"/apis/policy/{version}/poddisruptionbudgets?limit=1") is not None:
            return f"/apis/policy/{version}"
    raise PluginError("the cluster serves no PodDisruptionBudgets (policy/v1 or v1beta1)")


def _owned_budgets(api: KubeApi) -> list[tuple[str, str]]:
    """The PodDisruptionBudgets a CheckpointSchedule owns."""
    found = api.raw("GET", f"{_budgets_path(api)}/poddisruptionbudgets") or {}
    owned = []
    for pdb in found.get("items") or ():
        meta = pdb["metadata"]
        if any(o.get("kind") == CHECKPOINT_SCHEDULE.kind for o in meta.get("ownerReferences") or ()):
            owned.append((meta["namespace"], meta["name"]))
    return sorted(owned)


def _delete(api: KubeApi, kind: KindInfo, namespace: str, name: str) -> None:
    import kubernetes

    try:
        api._custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, kind.plural, name)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise PluginError(f"deleting {kind.kind} {namespace}/{name}: {exc.reason}") from None


def _patch(api: KubeApi, kind: KindInfo, namespace: str, name: str, patch: Body) -> None:
    import kubernetes

    try:
        api._custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, kind.plural, name, patch)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise PluginError(f"changing {kind.kind} {namespace}/{name}: {exc.reason}") from None


def _gone(api: KubeApi, kinds: list[KindInfo], timeout: float) -> list[tuple[KindInfo, str, str]]:
    """Wait up to `timeout` for every object of `kinds` to go; what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = [(kind, ns, name) for kind in kinds for ns, name in _objects(api, kind)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(1.0)


def _delete_webhook_configurations(api: KubeApi) -> list[str]:
    import kubernetes

    admission = kubernetes.client.AdmissionregistrationV1Api(api.client)
    deleted = []
    for kind, delete in (
        ("ValidatingWebhookConfiguration", admission.delete_validating_webhook_configuration),
        ("MutatingWebhookConfiguration", admission.delete_mutating_webhook_configuration),
    ):
        try:
            delete(WEBHOOK_CONFIGURATION)
            deleted.append(f"{kind} {WEBHOOK_CONFIGURATION}")
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise PluginError(f"deleting {kind} {WEBHOOK_CONFIGURATION}: {exc.reason}") from None
    return deleted


def grants_selector(release: str | None) -> str:
    """Every release's storage grants, or one release's."""
    return f"{GRANTS_SELECTOR},{RELEASE_LABEL}={release}" if release else GRANTS_SELECTOR


def _storage_grants(api: KubeApi, selector: str) -> list[tuple[str, str, str]]:
    """(plural, namespace, name) of the storage Roles and RoleBindings, in every namespace."""
    found = []
    for plural in ("rolebindings", "roles"):  # a binding first: it never names a Role already gone
        listed = api.raw("GET", f"{RBAC}/{plural}?labelSelector={selector}") or {}
        for item in listed.get("items") or ():
            meta = item["metadata"]
            found.append((plural, meta["namespace"], meta["name"]))
    return found


def _delete_storage_grants(api: KubeApi, grants: list[tuple[str, str, str]]) -> None:
    for plural, ns, name in grants:
        api.raw("DELETE", f"{RBAC}/namespaces/{ns}/{plural}/{name}")  # None: gone already


def uninstall(api: KubeApi, args: argparse.Namespace) -> int:
    running = _running(api)
    if running:
        raise PluginError("jobs are running; let them end (or delete them) first: " + ", ".join(running))
    schedules, budgets = _objects(api, CHECKPOINT_SCHEDULE), _owned_budgets(api)
    jobs = [(k, ns, n) for k in (CHECKPOINT_JOB, RESTORE_JOB) for ns, n in _objects(api, k)]
    checkpoints = _objects(api, CHECKPOINT)
    grants = _storage_grants(api, grants_selector(args.release))
    images = "deleted from S3" if args.delete_images else "left in S3"
    plan = [
        f"delete {len(schedules)} CheckpointSchedule(s), with the {len(budgets)} PodDisruptionBudget(s) "
        "they own",
        f"delete {len(jobs)} finished CheckpointJob(s) and RestoreJob(s)",
        f"delete {len(checkpoints)} Checkpoint(s), their images {images}",
        f"delete the webhook configurations {WEBHOOK_CONFIGURATION}",
        f"delete {len(grants)} storage Role(s) and RoleBinding(s) of the node agents "
        f"({', '.join(sorted({ns for _, ns, _ in grants})) or 'no namespace'})",
    ]
    if not args.yes:
        print("would (run again with --yes):")
        for step in plan:
            print(f"  {step}")
        return 0
    for ns, name in schedules:
        _delete(api, CHECKPOINT_SCHEDULE, ns, name)
    print(f"deleted {len(schedules)} CheckpointSchedule(s)")
    running = _running(api)  # a schedule may have fired before it went
    if running:
        raise PluginError("a job started meanwhile; let it end, then run this again: " + ", ".join(running))
    for kind, ns, name in jobs:
        _delete(api, kind, ns, name)
    print(f"deleted {len(jobs)} CheckpointJob(s) and RestoreJob(s)")
    for ns, name in checkpoints:
        if not args.delete_images:
            _patch(api, CHECKPOINT, ns, name, {"metadata": {"annotations": {RETAIN_IMAGES: "true"}}})
        _delete(api, CHECKPOINT, ns, name)
    left = _gone(api, [CHECKPOINT_SCHEDULE, CHECKPOINT_JOB, RESTORE_JOB, CHECKPOINT], args.timeout)
    for kind, ns, name in left:  # the operator did not release them in time: it may be gone already
        _patch(api, kind, ns, name, {"metadata": {"finalizers": None}})
        print(f"removed the finalizer of {kind.kind} {ns}/{name} (the operator did not)")
    print(f"deleted {len(checkpoints)} Checkpoint(s), their images {images}")
    by_hand = _budgets_gone(api, args.timeout)
    print(f"{len(budgets)} PodDisruptionBudget(s) of the schedules gone ({by_hand} deleted here)")
    for deleted in _delete_webhook_configurations(api):
        print(f"deleted {deleted}")
    # last: a job's storage is read through them until the job is gone
    grants = _storage_grants(api, grants_selector(args.release))
    _delete_storage_grants(api, grants)
    print(f"deleted {len(grants)} storage Role(s) and RoleBinding(s) of the node agents")
    print("now: helm uninstall; then each node's files (docs/uninstall.md)")
    return 0


def _budgets_gone(api: KubeApi, timeout: float) -> int:
    """The schedules' PDBs go with them (garbage collection); those still there after `timeout` are
    deleted here. How many that was."""
    deadline = time.monotonic() + timeout
    while (left := _owned_budgets(api)) and time.monotonic() < deadline:
        time.sleep(1.0)
    base = _budgets_path(api)
    for ns, name in left:
        api.raw("DELETE", f"{base}/namespaces/{ns}/poddisruptionbudgets/{name}")
    return len(left)


def add_parser(commands: Any) -> None:
    u = commands.add_parser("uninstall", help="remove what helm uninstall leaves (run it first)")
    u.add_argument("--yes", action="store_true", help="do it; without: say what would be done")
    u.add_argument("--delete-images", action="store_true", help="delete the Checkpoints' images in S3 too")
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the operator")
    u.add_argument("--release", help="only this Helm release's storage Roles (default: every release's)")
    u.set_defaults(run=uninstall)
