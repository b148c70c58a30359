"""The generated CRDs on the real v1.20 apiserver: accepted, defaults applied, bad objects rejected with a
message that names the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from ibckpt.api import (
    GROUP,
    KINDS,
    VERSION,
    CheckpointJob,
    CheckpointJobSpec,
    CheckpointJobStatus,
    CheckpointMode,
    LabelSelector,
    LocalObjectReference,
    ObjectMeta,
)
from ibckpt.api.crdgen import crd
from testbed.kube import establish_crds

pytestmark = pytest.mark.kube

NAMESPACE = "api-schema"


def _establish(api: kubernetes.client.ApiClient) -> None:
    establish_crds(api, [crd(info) for info in KINDS], replace=True)


@pytest.fixture(scope="module")
def custom(kube_api: kubernetes.client.ApiClient) -> Iterator[kubernetes.client.CustomObjectsApi]:
    _establish(kube_api)
    try:
        kubernetes.client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": NAMESPACE}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    yield kubernetes.client.CustomObjectsApi(kube_api)


def _job(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}}
    body.update(spec)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "CheckpointJob",
        "metadata": {"name": name},
        "spec": {key: value for key, value in body.items() if value is not None},
    }


def _create(custom: kubernetes.client.CustomObjectsApi, plural: str, body: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, body)
    return created


def _rejected(custom: kubernetes.client.CustomObjectsApi, plural: str, body: dict[str, Any]) -> str:
    with pytest.raises(kubernetes.client.ApiException) as info:
        _create(custom, plural, body)
    assert info.value.status == 422, info.value.body
    return str(info.value.body)


def test_defaults_apply_on_the_server(custom: kubernetes.client.CustomObjectsApi) -> None:
    created = _create(custom, "checkpointjobs", _job("defaults"))
    spec = created["spec"]
    assert CheckpointJob.from_wire(created).metadata.uid
    # Every default the model declares, and the server filled the same values in.
    assert spec == CheckpointJobSpec.from_wire(spec).to_wire()
    assert spec["mode"] == "LeaveRunning"
    assert spec["concurrencyPolicy"] == "Wait"
    assert spec["activeDeadlineSeconds"] == 3600
    assert spec["timeouts"] == CheckpointJobSpec.model_fields["timeouts"].default.to_wire()
    assert spec["timeouts"]["quiesceSeconds"] == 30

    inline = _create(
        custom,
        "checkpointjobs",
        _job("inline", storageRef=None, storage={"bucket": "ckpts", "credentialsSecretRef": {"name": "s3"}}),
    )
    assert inline["spec"]["storage"]["prefix"] == "ibckpt"
    assert inline["spec"]["storage"]["region"] == "us-east-1"
    assert inline["spec"]["storage"]["addressingStyle"] == "path"

    schedule = _create(
        custom,
        "checkpointschedules",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "CheckpointSchedule",
            "metadata": {"name": "hourly"},
            "spec": {"intervalSeconds": 3600, "template": _job("unused")["spec"]},
        },
    )
    assert schedule["spec"]["retention"] == {"keepLast": 3, "minKeep": 1}
    assert schedule["spec"]["template"]["timeouts"]["dumpSeconds"] == 600


@pytest.mark.parametrize(
    ("name", "spec", "field", "words"),
    [
        ("bad-mode", {"mode": "Sometimes"}, "spec.mode", "supported values"),
        ("bad-timeout", {"timeouts": {"quiesceSeconds": 0}}, "spec.timeouts.quiesceSeconds", "greater than"),
        ("bad-deadline", {"activeDeadlineSeconds": -5}, "spec.activeDeadlineSeconds", "greater than"),
        ("bad-policy", {"concurrencyPolicy": "Queue"}, "spec.concurrencyPolicy", "supported values"),
        ("bad-operator", {"selector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
         "spec.selector.matchExpressions.operator", "supported values"),
        ("empty-selector", {"selector": {}}, "spec.selector", "at least 1"),
        ("bad-kind", {"selector": None, "workloadRef": {"kind": "job", "name": "ring"}},
         "spec.workloadRef.kind", "should match"),
        ("no-workload-name", {"selector": None, "workloadRef": {"kind": "Job"}},
         "spec.workloadRef.name", "Required value"),
        ("bad-storage-name", {"storageRef": {"name": "Not_A_Name"}}, "spec.storageRef.name", "should match"),
        ("short-bucket", {"storageRef": None, "storage": {"bucket": "b",
         "credentialsSecretRef": {"name": "s"}}}, "spec.storage.bucket", "at least 3"),
        ("no-credentials", {"storageRef": None, "storage": {"bucket": "ckpts"}},
         "spec.storage.credentialsSecretRef", "Required value"),
        ("bad-sse", {"storageRef": None, "storage": {"bucket": "ckpts", "credentialsSecretRef": {"name": "s"},
         "encryption": {"mode": "rot13"}}}, "spec.storage.encryption.mode", "supported values"),
    ],
)  # fmt: skip
def test_bad_checkpoint_jobs_are_rejected_by_field(
    custom: kubernetes.client.CustomObjectsApi, name: str, spec: dict[str, Any], field: str, words: str
) -> None:
    body = _rejected(custom, "checkpointjobs", _job(name, **spec))
    assert field in body
    assert words in body


def test_exactly_one_of_each_choice(custom: kubernetes.client.CustomObjectsApi) -> None:
    # v1.20 reports a failed oneOf with the first alternative's missing field.
    both = _rejected(custom, "checkpointjobs", _job("both", workloadRef={"kind": "Job", "name": "ring"}))
    assert "one and only one schema (oneOf). Found 2 valid alternatives" in both
    neither = _rejected(custom, "checkpointjobs", _job("neither", selector=None))
    assert "Found none valid" in neither and "spec.selector: Required value" in neither
    no_storage = _rejected(custom, "checkpointjobs", _job("nostorage", storageRef=None))
    assert "Found none valid" in no_storage and "spec.storageRef: Required value" in no_storage
    missing = _job("nospec")
    del missing["spec"]
    assert "spec: Required value" in _rejected(custom, "checkpointjobs", missing)


def test_status_is_a_subresource_and_validated(custom: kubernetes.client.CustomObjectsApi) -> None:
    _create(custom, "checkpointjobs", _job("status"))
    status = CheckpointJobStatus(phase="Quiescing", pod_count=2, attempt="abc-3", step="quiesce")
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NAMESPACE, "checkpointjobs", "status", {"status": status.to_wire()}
    )
    got = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "checkpointjobs", "status")
    assert CheckpointJobStatus.from_wire(got["status"]) == status
    # A spec change through the main resource does not touch status, and status rejects unknown phases.
    with pytest.raises(kubernetes.client.ApiException) as info:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, "checkpointjobs", "status", {"status": {"phase": "Napping"}}
        )
    assert info.value.status == 422 and "status.phase" in str(info.value.body)


def test_other_kinds_accept_good_and_reject_bad(custom: kubernetes.client.CustomObjectsApi) -> None:
    def obj(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": {"name": name}, "spec": spec}

    storage = _create(
        custom,
        "checkpointstorages",
        obj("CheckpointStorage", "s3", {"bucket": "ckpts", "credentialsSecretRef": {"name": "s3"},
                                        "retention": {"keepLast": 5}}),
    )  # fmt: skip
    assert storage["spec"]["retention"] == {"keepLast": 5, "minKeep": 1}
    assert storage["spec"]["prefix"] == "ibckpt"
    restore = _create(custom, "restorejobs", obj("RestoreJob", "back", {"checkpointName": "ring-1"}))
    assert restore["spec"]["avoidSourceNodes"] is False
    assert restore["spec"]["timeouts"]["downloadSeconds"] == 1800
    body = _rejected(custom, "restorejobs", obj("RestoreJob", "nowhere", {"avoidNodes": ["node-1"]}))
    assert "spec.checkpointName" in body
    body = _rejected(custom, "checkpoints", obj("Checkpoint", "orphan", {"storageRef": {"name": "s3"}}))
    assert "spec.manifestKey" in body
    body = _rejected(
        custom,
        "checkpointschedules",
        obj("CheckpointSchedule", "fast", {"intervalSeconds": 5, "template": {}}),
    )
    assert "spec.intervalSeconds" in body


def test_printer_columns_short_names_and_category(kube_api: kubernetes.client.ApiClient) -> None:
    _establish(kube_api)
    ext = kubernetes.client.ApiextensionsV1Api(kube_api)
    for info in KINDS:
        got = ext.read_custom_resource_definition(info.crd_name)
        assert got.spec.names.short_names == list(info.short_names)
        assert got.spec.names.categories == ["ibckpt"]
        version = got.spec.versions[0]
        assert version.subresources.status == {}
        assert [c.name for c in version.additional_printer_columns] == [c.name for c in info.printer_columns]
        # The server computed no non-structural complaint.
        conditions = {c.type: c.status for c in (got.status.conditions or [])}
        assert conditions.get("NonStructuralSchema") is None, conditions


def test_an_object_built_from_the_models_is_accepted(custom: kubernetes.client.CustomObjectsApi) -> None:
    job = CheckpointJob(
        metadata=ObjectMeta(name="typed", labels={"team": "hpc"}),
        spec=CheckpointJobSpec(
            selector=LabelSelector(match_labels={"app": "ring"}),
            storage_ref=LocalObjectReference(name="s3"),
            mode=CheckpointMode.STOP,
        ),
    )
    created = CheckpointJob.from_wire(_create(custom, "checkpointjobs", job.to_wire()))
    assert created.spec == job.spec  # the model's defaults and the server's agree
    assert created.metadata.labels == {"team": "hpc"} and created.metadata.generation == 1
