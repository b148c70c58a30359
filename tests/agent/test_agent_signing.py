"""The agent restores only manifests signed with its image key set: a checkpoint the tenant wrote with its
own S3 keys fails the restore session with the reason, before anything is staged on the node."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from pathlib import Path

import pytest
from agent.agent_harness import IMAGE_KEYS, Running
from agent.test_agent_disk import SECRET, agent_options, location, secret_data, wait_finished
from pydantic import SecretStr

from ibckpt.agentapi import ImageDestination, ImageSource, RestoreRank, RestoreRequest
from ibckpt.store import ImageStore, ManifestKeys, StoreConfig
from ibckpt_node.agent.kubesecrets import StagingError
from ibckpt_node.agent.staging import image_keys, stage_trees, store_config
from ibckpt_node.trees import TREE_MANIFEST
from testbed.s3 import S3Server


def dumped_tree(root: Path) -> Path:
    (root / "ring-0.main").mkdir(parents=True)
    (root / "ring-0.main" / "pages-1.img").write_bytes(os.urandom(4000))
    (root / "ring-0.main" / TREE_MANIFEST).write_text(json.dumps({"runtime": "runc", "restore_args": ""}))
    return root


def restore_through_the_agent(agent: Running, s3_server: S3Server, bucket: str, checkpoint_id: str) -> str:
    """The failure message of a restore session of ring/<checkpoint_id> on the running agent."""
    agent_options(agent, s3_server)
    session = "rsj-" + secrets.token_hex(3)
    request = RestoreRequest(
        session_id=session,
        coordinator="127.0.0.1:9",  # never reached: the download is refused first
        session_token=SecretStr("t"),
        job="ring",
        checkpoint=f"team/{checkpoint_id}",
        images=ImageSource(
            location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id=checkpoint_id
        ),
        ranks=[RestoreRank(container="main", rank_key="ring/ring-0/main/1", namespace="team", pod="ring-0")],
    )
    client = agent.client()
    client.restore(request)
    report = wait_finished(client, session)
    assert report.state == "Failed", report
    return report.message


def _bucket(s3_server: S3Server) -> tuple[str, StoreConfig, ImageDestination]:
    """A fresh bucket, the agent's store configuration for it and checkpoint c1's destination there."""
    bucket = "sign-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    config = store_config(location(s3_server, bucket), SECRET, secret_data(s3_server))
    destination = ImageDestination(
        location=location(s3_server, bucket), credentials=SECRET, job="ring", checkpoint_id="c1"
    )
    return bucket, config, destination


def test_a_checkpoint_the_tenant_wrote_is_refused_and_nothing_is_staged(
    agent: Running, tmp_path: Path, s3_server: S3Server
) -> None:
    bucket = "sign-" + secrets.token_hex(6)
    s3_server.create_bucket(bucket)
    config = store_config(location(s3_server, bucket), SECRET, secret_data(s3_server))
    tenant = ImageStore.open(config)  # the tenant's S3 keys, no image key
    with tenant.writer("ring", "forged") as writer:
        writer.add_tree(dumped_tree(tmp_path / "dumped"), under="node-x")
        writer.stage("node-x")
    tenant.commit_parts("ring", "forged", ["node-x"])
    message = restore_through_the_agent(agent, s3_server, bucket, "forged")
    assert "manifest ring/forged" in message and "is not signed: refused" in message, message
    assert (
        not (tmp_path / "state" / "restore").exists()
        or list((tmp_path / "state" / "restore").rglob("*")) == []
    )


def test_a_checkpoint_signed_with_another_key_set_is_refused(
    agent: Running, tmp_path: Path, s3_server: S3Server
) -> None:
    bucket, config, destination = _bucket(s3_server)
    other = ManifestKeys({"other-cluster": secrets.token_bytes(32)})
    stage_trees(config, destination, "node-x", dumped_tree(tmp_path / "dumped"), [("ring-0.main", "ring-0")],
                lambda n: None, other)  # fmt: skip
    ImageStore.open(config, signing=other).commit_parts("ring", "c1", ["node-x"])
    message = restore_through_the_agent(agent, s3_server, bucket, "c1")
    assert "signed with key 'other-cluster', which is not in the image key set (test-key)" in message, message


def test_an_agent_without_its_key_set_stages_and_restores_nothing(
    agent: Running, tmp_path: Path, s3_server: S3Server
) -> None:
    bucket, config, destination = _bucket(s3_server)
    stage_trees(config, destination, "node-x", dumped_tree(tmp_path / "dumped"), [("ring-0.main", "ring-0")],
                lambda n: None, IMAGE_KEYS)  # fmt: skip
    ImageStore.open(config, signing=IMAGE_KEYS).commit_parts("ring", "c1", ["node-x"])
    sessions = agent.server.sessions
    sessions.agent = dataclasses.replace(sessions.agent, image_keys=tmp_path / "not-mounted")
    assert "cannot read" in restore_through_the_agent(agent, s3_server, bucket, "c1")
    with pytest.raises(StagingError, match=r"no image key set \(--image-keys\)"):
        image_keys(None)
