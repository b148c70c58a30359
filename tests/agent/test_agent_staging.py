"""Staging a node's images to a real S3 (SeaweedFS, SigV4 enforced): the credentials come from a Secret's
data as the agent reads it, the node's trees become its part, and the operator's commit of the parts
gives back the same bytes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import urllib.error
from collections.abc import Sequence
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from agent.agent_harness import IMAGE_KEYS
from node.test_tcp_remap import _addresses as addresses
from node.test_tcp_remap import _files_img as files_img
from node.test_tcp_remap import _isk as isk

from ibckpt.agentapi import ImageDestination, ImageSource, SecretRef
from ibckpt.api.storage import S3Location
from ibckpt.store import CheckpointRef, ImageStore
from ibckpt_node import tcp_remap
from ibckpt_node.agent import restoring
from ibckpt_node.agent.kubesecrets import KubeSecrets, StagingError
from ibckpt_node.agent.staging import read_config, stage_trees, store_config
from ibckpt_node.trees import TREE_MANIFEST
from testbed.s3 import S3Server

SECRET = SecretRef(namespace="ibckpt", name="s3-credentials")


def _secret(s3: S3Server) -> dict[str, str]:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {"AWS_ACCESS_KEY_ID": b64(s3.access_key), "AWS_SECRET_ACCESS_KEY": b64(s3.secret_key)}


def _destination(s3: S3Server, bucket: str, **location: object) -> ImageDestination:
    return ImageDestination(
        location=S3Location.model_validate(
            {
                "endpoint": s3.endpoint,
                "region": s3.region,
                "bucket": bucket,
                "prefix": "lab",
                "credentialsSecretRef": {"name": SECRET.name},
                **location,
            }
        ),
        credentials=SECRET,
        job="ring",
        checkpoint_id="ckpt-1",
    )


def test_a_nodes_trees_are_staged_as_its_part_and_commit_restores_them(
    s3_server: S3Server, tmp_path: Path
) -> None:
    bucket = "agent-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    images = tmp_path / "images"
    files = {
        "pod-a.main/pages-1.img": os.urandom(3 * 1024 * 1024 + 17),
        "pod-a.main/core-1.img": b"core",
        "pod-b.main/pages-1.img": os.urandom(100_000),
    }
    for name, data in files.items():
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes(data)
    destination = _destination(s3_server, bucket)
    config = store_config(destination.location, destination.credentials, _secret(s3_server))
    uploaded: list[int] = []
    total = stage_trees(
        config,
        destination,
        "node-1",
        images,
        [("pod-a.main", "pod-a"), ("pod-b.main", "pod-b")],
        uploaded.append,
        IMAGE_KEYS,
    )
    assert total == sum(len(d) for d in files.values())
    assert sum(uploaded) > 0
    store = ImageStore.open(config, signing=IMAGE_KEYS)
    manifest = store.commit_parts("ring", "ckpt-1", ["node-1"])
    assert [(r.pod, r.node, r.root) for r in manifest.ranks] == [
        ("pod-a", "node-1", "node-1/pod-a.main"),
        ("pod-b", "node-1", "node-1/pod-b.main"),
    ]
    back = tmp_path / "back"
    store.restore(CheckpointRef("ring", "ckpt-1"), back)
    for name, data in files.items():
        assert (back / "node-1" / name).read_bytes() == data


def test_two_nodes_parts_number_their_ranks_apart_and_commit_together(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Each node numbers its trees from the operator's first_rank: the commit merges the parts (it refuses
    two parts that claim one rank number, which is what happened when every node started at 0)."""
    bucket = "agent-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    config = None
    for first_rank, node, pod in ((0, "node-1", "ring-0"), (1, "node-2", "ring-1")):
        images = tmp_path / node
        (images / f"{pod}.main").mkdir(parents=True)
        (images / f"{pod}.main" / "pages-1.img").write_bytes(os.urandom(5000))
        destination = _destination(s3_server, bucket).model_copy(update={"first_rank": first_rank})
        config = store_config(destination.location, destination.credentials, _secret(s3_server))
        stage_trees(config, destination, node, images, [(f"{pod}.main", pod)], lambda size: None, IMAGE_KEYS)
    assert config is not None
    manifest = ImageStore.open(config, signing=IMAGE_KEYS).commit_parts(
        "ring", "ckpt-1", ["node-1", "node-2"]
    )
    ranks = [(r.rank, r.pod, r.node) for r in manifest.ranks]
    assert ranks == [(0, "ring-0", "node-1"), (1, "ring-1", "node-2")]


def test_what_the_agent_cannot_do_is_refused_and_no_secret_value_is_shown(s3_server: S3Server) -> None:
    wrong = {"username": base64.b64encode(b"very-secret-value").decode()}
    destination = _destination(s3_server, "any-bucket")
    with pytest.raises(StagingError) as no_keys:
        store_config(destination.location, destination.credentials, wrong)
    assert "ibckpt/s3-credentials" in str(no_keys.value) and "username" in str(no_keys.value)
    assert "very-secret-value" not in str(no_keys.value)
    encrypted = _destination(
        s3_server, "any-bucket", encryption={"mode": "client", "keySecretRef": {"name": "key"}}
    )
    with pytest.raises(StagingError, match="client-side encryption needs the key"):
        store_config(encrypted.location, encrypted.credentials, _secret(s3_server))
    # a key Secret without a usable key: named, its value never shown
    for bad in ({"other": "eA=="}, {"IBCKPT_ENCRYPTION_KEY": base64.b64encode(b"short-key").decode()}):
        reader = _reader({SECRET.name: _secret(s3_server), "key": bad})
        with pytest.raises(StagingError, match="the encryption key Secret ibckpt/key") as refused:
            asyncio.run(read_config(reader, encrypted.location, encrypted.credentials, Path("/nonexistent")))
        assert "short-key" not in str(refused.value)


def _reader(secrets_by_name: dict[str, dict[str, str]]) -> Any:
    """The agent's Secret reader over fixed data (the Secrets' RBAC is test_secret_grants.py's)."""

    async def read(namespace: str, name: str) -> dict[str, str]:
        assert namespace == SECRET.namespace, namespace  # always the storage's namespace
        return secrets_by_name[name]

    return read


def test_client_side_encryption_seals_what_the_agent_stages_and_restores_with_the_key(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Mode client: the agent reads the key from the storage's Secret, and no object in the bucket holds
    the plain images; the commit restores them byte for byte with the key, and not without it."""
    bucket = "agent-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    plain = b"ibckpt-plain-marker-" * 5000  # compressible, and easy to look for
    (tmp_path / "images" / "pod-a.main").mkdir(parents=True)
    (tmp_path / "images" / "pod-a.main" / "pages-1.img").write_bytes(plain)
    key = base64.b64encode(base64.b64encode(os.urandom(32))).decode()  # the Secret's data is base64
    reader = _reader({SECRET.name: _secret(s3_server), "sealing": {"IBCKPT_ENCRYPTION_KEY": key}})
    destination = _destination(
        s3_server, bucket, encryption={"mode": "client", "keySecretRef": {"name": "sealing"}}
    )
    config = asyncio.run(read_config(reader, destination.location, destination.credentials, tmp_path / "ca"))
    trees = [("pod-a.main", "pod-a")]
    stage_trees(config, destination, "node-1", tmp_path / "images", trees, lambda n: None, IMAGE_KEYS)
    store = ImageStore.open(config, signing=IMAGE_KEYS)
    store.commit_parts("ring", "ckpt-1", ["node-1"])
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any("/chunks/" in k for k in keys), keys
    for k in keys:
        body = client.get_object(Bucket=bucket, Key=k)["Body"].read()
        assert b"ibckpt-plain-marker" not in body, k
    store.restore(CheckpointRef("ring", "ckpt-1"), tmp_path / "back")
    assert (tmp_path / "back" / "node-1" / "pod-a.main" / "pages-1.img").read_bytes() == plain
    keyless = store_config(
        _destination(s3_server, bucket).location, destination.credentials, _secret(s3_server)
    )
    with pytest.raises(Exception, match="encrypted client-side"):
        ImageStore.open(keyless, signing=IMAGE_KEYS).restore(
            CheckpointRef("ring", "ckpt-1"), tmp_path / "nokey"
        )


def test_server_side_encryption_is_asked_for_every_object_the_agent_writes(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """SSE-S3 needs no key at the agent, only a header on each PUT: the server says each object it stored
    (chunks, the part) is encrypted at rest."""
    bucket = "agent-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    (tmp_path / "pod-a.main").mkdir()
    (tmp_path / "pod-a.main" / "pages-1.img").write_bytes(os.urandom(200_000))
    destination = _destination(s3_server, bucket, encryption={"mode": "sse-s3"})
    config = store_config(destination.location, destination.credentials, _secret(s3_server))
    stage_trees(
        config, destination, "node-1", tmp_path, [("pod-a.main", "pod-a")], lambda size: None, IMAGE_KEYS
    )
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any("/chunks/" in k for k in keys) and any("/parts/" in k for k in keys), keys
    said = {k: client.head_object(Bucket=bucket, Key=k).get("ServerSideEncryption") for k in keys}
    assert set(said.values()) == {"AES256"}, said


class _RecordedLock(tcp_remap.ConnectionLock):
    """The lock without iptables (the host test may not own the node's firewall): what it would hold."""

    def extend(self, connections: Sequence[tcp_remap.Connection]) -> None:
        self.connections += [c for c in dict.fromkeys(connections) if c not in self.connections]


def test_a_hostnetwork_containers_connections_follow_the_address_map_before_it_is_staged(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A container that held a TCP connection from node-1's address to node-2's is restored on node-2 with
    the map the operator computed ({node-1: node-2}): its staged images already name the new address when
    staged.json appears (the wrapper restores as soon as it does), and the connection, as it will be
    restored, is held until every node has restored."""
    a, b = "10.77.0.1", "10.77.0.2"
    bucket = "agent-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    tree = tmp_path / "dump" / "ring-0.main"
    files_img(tree, [isk(11, 2, a, b, 40000, 18600, 1), isk(12, 2, a, "0.0.0.0", 18600, 0, 10)])
    (tree / "in.json").unlink()
    (tree / "tcp-stream-11.img").write_bytes(b"stream")
    (tree / TREE_MANIFEST).write_text(json.dumps({"runtime": "runc", "restore_args": "--tcp-established"}))
    destination = _destination(s3_server, bucket)
    config = store_config(destination.location, destination.credentials, _secret(s3_server))
    stage_trees(
        config,
        destination,
        "node-1",
        tmp_path / "dump",
        [("ring-0.main", "ring-0")],
        lambda n: None,
        IMAGE_KEYS,
    )
    ImageStore.open(config, signing=IMAGE_KEYS).commit_parts("ring", "ckpt-1", ["node-1"])

    source = ImageSource(
        location=destination.location, credentials=SECRET, job="ring", checkpoint_id="ckpt-1"
    )
    planned = [restoring.ContainerRestore("", "team", "ring-0", "main", "node-1/ring-0.main", ("k",))]
    root = tmp_path / "restore"
    lock = _RecordedLock([])
    restoring.stage(
        config, source, "team/ckpt", planned, lambda ns, pod, c: str(root / ns / pod / c), lambda n: None,
        tcp_remap.parse_map([f"{a}={b}"]), lock, keys=IMAGE_KEYS,
    )  # fmt: skip
    staged = root / "team" / "ring-0" / "main"
    assert json.loads((staged / "staged.json").read_text())["restore_args"] == "--tcp-established"
    assert addresses(staged / "images") == {11: (b, b), 12: (b, "0.0.0.0")}
    assert [c.describe() for c in lock.connections] == [f"{b}:40000 -> {b}:18600"]


def test_an_address_map_that_is_not_one_is_refused_before_anything_is_staged() -> None:
    with pytest.raises(ValueError, match="mapped twice"):
        tcp_remap.parse_map(["10.0.0.1=10.0.0.2", "10.0.0.1=10.0.0.3"])


def test_a_failed_runc_restore_is_explained_by_the_error_lines_of_its_criu_log(tmp_path: Path) -> None:
    planned = [
        restoring.ContainerRestore("", "team", "ring-0", "main", "node-1/ring-0.main", ("k",)),
        restoring.ContainerRestore("", "team", "ring-1", "main", "node-2/ring-1.main", ("k",)),
    ]
    where = tmp_path / "team" / "ring-0" / "main" / "images"
    where.mkdir(parents=True)
    (where / "restore.log").write_text(
        "(00.001) Restoring\n(00.420) Error (criu/sk-inet.c:1111): Can't bind inet socket (id 7): "
        "Address already in use\n(00.421) Error (criu/cr-restore.c:2397): Restoring FAILED.\n"
    )
    found = restoring.restore_errors(planned, lambda ns, pod, c: str(tmp_path / ns / pod / c))
    # ring-1 has no log (it was never restored): only ring-0 is named, with CRIU's own words
    assert len(found) == 1 and found[0].startswith("runc restore of ring-0/main: "), found
    assert "Address already in use" in found[0] and "Restoring FAILED" in found[0], found


def test_a_ca_bundle_is_read_from_the_storages_namespace_and_given_to_the_store(
    s3_server: S3Server, tmp_path: Path
) -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    secrets_of = {
        ("ibckpt", SECRET.name): _secret(s3_server),
        ("ibckpt", "minio-ca"): {"ca.pem": base64.b64encode(pem).decode()},
    }
    asked: list[tuple[str, str]] = []

    async def read(namespace: str, name: str) -> dict[str, str]:
        asked.append((namespace, name))
        return secrets_of.get((namespace, name), {})

    destination = _destination(
        s3_server, "any-bucket", caBundleSecretRef={"name": "minio-ca", "key": "ca.pem"}
    )
    config = asyncio.run(read_config(read, destination.location, destination.credentials, tmp_path / "ca"))
    assert asked == [("ibckpt", SECRET.name), ("ibckpt", "minio-ca")]  # both in the storage's namespace
    assert config.ca_bundle is not None and Path(config.ca_bundle).read_bytes() == pem
    again = asyncio.run(read_config(read, destination.location, destination.credentials, tmp_path / "ca"))
    assert again.ca_bundle == config.ca_bundle and len(list((tmp_path / "ca").iterdir())) == 1
    wrong_key = _destination(s3_server, "any-bucket", caBundleSecretRef={"name": "minio-ca"})
    with pytest.raises(StagingError, match=r"ibckpt/minio-ca has no valid ca\.crt"):
        asyncio.run(read_config(read, wrong_key.location, wrong_key.credentials, tmp_path / "ca"))


class ScriptedSecrets(KubeSecrets):
    """The reader's loop over scripted answers: an HTTP status to fail with, or the Secret's data."""

    def __init__(self, answers: list[int | dict[str, str]], grant_wait_s: float) -> None:
        self.answers, self.grant_wait_s, self.asked = answers, grant_wait_s, 0

    def _get(self, namespace: str, name: str) -> dict[str, str]:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, int):
            raise urllib.error.HTTPError("https://apiserver", answer, "no", Message(), None)
        return answer


def test_a_grant_the_authorizer_has_not_seen_yet_is_waited_for_briefly() -> None:
    # the operator grants the read just before its call: a 403 is asked again, for a bound only
    late = ScriptedSecrets([403, 403, {"k": "dg=="}], grant_wait_s=5.0)
    assert asyncio.run(late("team-a", "s3")) == {"k": "dg=="} and late.asked == 3
    never = ScriptedSecrets([403], grant_wait_s=0.6)
    with pytest.raises(StagingError, match="cannot read Secret team-a/s3: HTTP 403"):
        asyncio.run(never("team-a", "s3"))
    missing = ScriptedSecrets([404], grant_wait_s=5.0)
    with pytest.raises(StagingError, match="HTTP 404"):
        asyncio.run(missing("team-a", "s3"))
    assert missing.asked == 1
