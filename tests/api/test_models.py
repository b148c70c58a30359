"""The API models and the CRDs generated from them, without an apiserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field, ValidationError

from ibckpt.api import (
    API_VERSION,
    GROUP,
    KINDS,
    VERSION,
    CheckpointJob,
    CheckpointJobSpec,
    CheckpointJobStatus,
    CheckpointSpec,
    Condition,
    ConditionStatus,
    Encryption,
    JobPhase,
    PodRow,
    RestoreJobSpec,
)
from ibckpt.api.crdgen import main as crdgen_main
from ibckpt.api.crdgen import rendered
from ibckpt.api.schema import SchemaError, apply_defaults, structural_schema

ROOT = Path(__file__).resolve().parents[2]
MINIMAL_JOB: dict[str, Any] = {"selector": {"matchLabels": {"app": "ring"}}, "storageRef": {"name": "s3"}}


def test_crds_directory_is_what_the_models_generate() -> None:
    wanted = rendered()
    on_disk = {path.name: path.read_text() for path in (ROOT / "crds").glob("*.yaml")}
    assert on_disk == wanted, "crds/ is stale: run python -m ibckpt.api.crdgen"
    # The chart ships the same files through its symlink.
    chart = {path.name: path.read_text() for path in (ROOT / "charts" / "ibckpt" / "crds").glob("*.yaml")}
    assert chart == wanted
    assert crdgen_main(["--check"]) == 0


def test_check_mode_reports_a_hand_edit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, text in rendered().items():
        (tmp_path / name).write_text(text)
    assert crdgen_main(["--check", str(tmp_path)]) == 0
    job = tmp_path / "checkpointjob.yaml"
    job.write_text(job.read_text().replace("default: 30", "default: 31"))
    assert crdgen_main(["--check", str(tmp_path)]) == 1
    assert "checkpointjob.yaml: differs" in capsys.readouterr().err
    assert crdgen_main([str(tmp_path)]) == 0  # regenerating repairs it
    assert crdgen_main(["--check", str(tmp_path)]) == 0


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(_walk(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_walk(value, f"{path}/{index}"))
    return found


@pytest.mark.parametrize("info", KINDS, ids=lambda info: info.kind)
def test_every_schema_is_structural_for_a_1_20_apiserver(info: Any) -> None:
    document = yaml.safe_load(rendered()[f"{info.singular}.yaml"])
    version = document["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert document["spec"]["names"]["categories"] == ["ibckpt"]
    assert document["spec"]["names"]["shortNames"]
    schema = version["schema"]["openAPIV3Schema"]
    for where, node in _walk(schema):
        assert "x-kubernetes-validations" not in node, where  # CEL: not on 1.20
        assert "$ref" not in node and "title" not in node and "const" not in node, where
        if where.endswith("/properties") or "/allOf/" in where or "/oneOf/" in where:
            continue
        if node.get("type") == "object" or "properties" in node:
            assert node.get("type") == "object", where
            assert node.get("additionalProperties") is not False, where
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, where  # OpenAPI 3.0 form
    for column in version["additionalPrinterColumns"]:
        assert column["jsonPath"].startswith("."), column


def test_server_defaults_match_the_models_defaults() -> None:
    schema = structural_schema(CheckpointJobSpec)
    assert apply_defaults(MINIMAL_JOB, schema) == CheckpointJobSpec.from_wire(MINIMAL_JOB).to_wire()
    inline = {"workloadRef": {"kind": "Job", "name": "ring"}, "storage": {"bucket": "ckpts",
              "credentialsSecretRef": {"name": "s3"}}}  # fmt: skip
    assert apply_defaults(inline, schema) == CheckpointJobSpec.from_wire(inline).to_wire()
    restore = {"checkpointName": "ring-1"}
    assert (
        apply_defaults(restore, structural_schema(RestoreJobSpec))
        == RestoreJobSpec.from_wire(restore).to_wire()
    )
    # Nested defaults are written once, on their own fields, not copied into the parent's default.
    assert schema["properties"]["timeouts"]["default"] == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"storageRef": {"name": "s3"}}, "exactly one of selector and workloadRef"),
        (
            {**MINIMAL_JOB, "workloadRef": {"kind": "Job", "name": "ring"}},
            "exactly one of selector and workloadRef",
        ),
        ({"selector": {"matchLabels": {}}, "storageRef": {"name": "s3"}}, "at least one rule"),
        ({"selector": {"matchLabels": {"a": "b"}}}, "exactly one of storageRef and storage"),
        ({**MINIMAL_JOB, "mode": "Pause"}, "mode"),
        ({**MINIMAL_JOB, "timeouts": {"drainSeconds": 0}}, "timeouts.drainSeconds"),
    ],
)
def test_python_side_rejects_what_the_schema_cannot(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointJobSpec.from_wire(spec)
    assert message in str(info.value)


def test_encryption_mode_needs_its_key() -> None:
    with pytest.raises(ValidationError, match="sse-kms needs kmsKeyId"):
        Encryption.from_wire({"mode": "sse-kms"})
    with pytest.raises(ValidationError, match="client needs keySecretRef"):
        Encryption.from_wire({"mode": "client"})
    assert Encryption.from_wire({"mode": "client", "keySecretRef": {"name": "k"}}).key_secret_ref is not None


def test_wire_form_is_camel_case_and_round_trips() -> None:
    status = CheckpointJobStatus(
        phase=JobPhase.UPLOADING,
        pod_count=1,
        pods=[PodRow(name="ring-0", uid="u0", node="node-1", phase="Dumped", bytes=10, seconds=0.5)],
        conditions=[Condition(type="Progressing", status=ConditionStatus.TRUE, reason="Uploading")],
    )
    wire = status.to_wire()
    assert wire["podCount"] == 1 and wire["pods"][0]["uid"] == "u0"
    assert "pod_count" not in wire and "checkpointName" not in wire  # unset fields are left out
    assert CheckpointJobStatus.from_wire(wire) == status
    # Fields a newer operator wrote are ignored, not an error.
    assert CheckpointJobStatus.from_wire({**wire, "someday": 1}) == status


def test_checkpoint_needs_a_storage() -> None:
    with pytest.raises(ValidationError, match="exactly one of storageRef and storage"):
        CheckpointSpec.from_wire({"manifestKey": "ibckpt/v1/manifests/j/c.json"})


class _Union(BaseModel):
    value: int | str


class _Exclusive(BaseModel):
    value: float = Field(gt=0)


def test_schema_translation_refuses_what_is_not_structural() -> None:
    with pytest.raises(SchemaError, match="branch may only hold"):
        structural_schema(_Union)
    assert structural_schema(_Exclusive)["properties"]["value"] == {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
    }


def test_whole_objects_read_what_the_apiserver_returns() -> None:
    assert f"{GROUP}/{VERSION}" == API_VERSION
    body = {
        "apiVersion": "ibckpt.io/v1alpha1",
        "kind": "CheckpointJob",
        "metadata": {
            "name": "ring-move",
            "namespace": "hpc",
            "uid": "0b9d",
            "generation": 2,
            "creationTimestamp": "2026-11-24T22:00:00Z",
            "managedFields": [{"manager": "kubectl"}],  # not modelled: ignored
        },
        "spec": CheckpointJobSpec.from_wire(MINIMAL_JOB).to_wire(),
    }
    job = CheckpointJob.from_wire(body)
    assert (job.metadata.name, job.metadata.generation, job.status) == ("ring-move", 2, None)
    assert job.to_wire()["metadata"] == {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    with pytest.raises(ValidationError, match="kind"):
        CheckpointJob.from_wire({**body, "kind": "RestoreJob"})
