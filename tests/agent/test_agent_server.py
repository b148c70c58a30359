"""The node agent's API on the host: the real server, registry socket and client; TokenReview stubbed.

The real TokenReview against a real apiserver, from a pod to an agent on a node, is tests/helm's.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from agent.agent_harness import Running, register
from pydantic import SecretStr

from ibckpt.agentapi import (
    LEADER_EPOCH_HEADER,
    AbortRequest,
    AgentClient,
    AgentError,
    CheckpointRequest,
    LeaderEpoch,
    RankRef,
    RestoreRequest,
)


def test_health_needs_no_token_everything_else_does(agent: Running) -> None:
    assert agent.client("none").healthy()
    status, headers, body = agent.raw("GET", "/v1/info")
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert "bearer token is required" in json.loads(body)["error"]
    status, _, _ = agent.raw("GET", "/v1/info", {"Authorization": "Basic b3A6b3A="})
    assert status == 401
    with pytest.raises(AgentError) as refused:
        agent.client("forged").info()
    assert refused.value.status == 401
    assert "forged" not in str(refused.value)


def test_no_verdict_from_the_apiserver_is_503_not_401(agent: Running) -> None:
    with pytest.raises(AgentError) as unavailable:
        agent.client("apiserver-down").info()
    assert unavailable.value.status == 503
    assert agent.client().info().node == "node-x"  # not remembered as anything


def test_another_service_account_is_forbidden(agent: Running) -> None:
    with pytest.raises(AgentError) as refused:
        agent.client("other-token").containers()
    assert refused.value.status == 403
    assert "system:serviceaccount:default:default may not use the node agent" in refused.value.message


def test_a_deposed_leaders_epoch_is_refused_and_the_fence_outlives_the_agent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = Running(state)

    def leader(epoch: LeaderEpoch | None, port: int | None = None, token: str = "op-token") -> AgentClient:
        return AgentClient(
            "127.0.0.1",
            port or agent.port,
            tls=agent.pki.client(),
            token=token,
            timeout_s=5,
            leader_epoch=epoch,
        )

    try:
        # an agent no leader has driven takes a caller that does not elect (tests, a first install)
        assert agent.client().info().node == "node-x"
        assert leader((1000, 3)).info().node == "node-x"
        assert (state / "leader-epoch").read_text() == "1000:3\n"
        refusals = {
            (1000, 2): "operator epoch 1000:2 was deposed: epoch 1000:3 leads this node now",
            (999, 7): "operator epoch 999:7 was deposed",  # an older Lease's, however many transitions
            None: "the call carries no leader epoch, and operator epoch 1000:3 leads this node",
        }
        for deposed, says in refusals.items():
            with pytest.raises(AgentError) as refused:
                leader(deposed).checkpoint(_checkpoint("uid-none"))
            assert refused.value.status == 409 and says in refused.value.message, refused.value
        # a stranger's epoch never moves the fence: the token is checked first
        with pytest.raises(AgentError) as stranger:
            leader((5000, 0), token="other-token").info()
        assert stranger.value.status == 403
        headers = {"Authorization": "Bearer op-token", LEADER_EPOCH_HEADER: "1000:-4"}
        status, _, body = agent.raw("GET", "/v1/info", headers)
        assert status == 409 and b"is not <seconds>:<transitions>" in body
        assert leader((2000, 0)).info().ready  # a Lease made again (a reinstall) leads from now on
    finally:
        agent.stop()
    # a restarted agent still knows the newest leader
    again = Running(state, agent.pki)  # the same Secret, mounted again
    try:
        with pytest.raises(AgentError) as late:
            leader((1000, 3), again.port).containers()
        assert late.value.status == 409 and "epoch 2000:0 leads" in late.value.message
        assert leader((2000, 0), again.port).containers().node == "node-x"
    finally:
        again.stop()


def test_operator_sees_the_node_and_its_registered_containers(
    agent: Running, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    made = register(tmp_path / "state", sleeper.pid, "c1", sockets=2)
    try:
        client = agent.client()
        info = client.info()
        assert (info.node, info.ready, info.shim_present) == ("node-x", True, False)
        assert info.address == f"127.0.0.1:{agent.port}"
        [c] = info.containers
        assert (c.pod, c.pod_uid, c.container, c.shim) == ("pod-c1", "uid-c1", "main", True)
        assert c.pid == sleeper.pid
        assert [Path(s).name for s in c.sockets] == ["1.sock", "2.sock"]
        assert client.containers().containers == info.containers
        # one TokenReview for the token, then it is remembered
        client.info()
        assert agent.reviewer.reviews == 1
    finally:
        for s in made:
            s.close()


def _checkpoint(pod_uid: str, container: str = "main", pod: str = "") -> CheckpointRequest:
    return CheckpointRequest(
        session_id="s-1",
        coordinator="127.0.0.1:9",
        session_token=SecretStr("session-secret"),
        job="ring",
        ranks=[RankRef(pod_uid=pod_uid, container=container, pod=pod)],
    )


def test_a_session_for_containers_the_agent_cannot_checkpoint_is_refused_with_the_reason(
    agent: Running, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    made = register(tmp_path / "state", sleeper.pid, "plain", shim=False)
    try:
        client = agent.client()
        with pytest.raises(AgentError) as unknown:
            client.checkpoint(_checkpoint("uid-nope"))
        assert unknown.value.status == 422
        assert "container main of pod uid-nope is not registered on node-x" in unknown.value.message
        with pytest.raises(AgentError) as named:  # the operator names the pod: the message says which
            client.checkpoint(_checkpoint("uid-nope", pod="ml/gone-0"))
        assert "container main of pod ml/gone-0 (uid uid-nope) is not registered" in named.value.message
        with pytest.raises(AgentError) as plain:
            client.checkpoint(_checkpoint("uid-plain"))
        assert plain.value.status == 422
        assert "ml/pod-plain container main runs without the shim (no ibckpt-runc)" in plain.value.message
        with pytest.raises(AgentError) as missing:
            client.session("s-1")
        assert missing.value.status == 404
    finally:
        for s in made:
            s.close()


def test_malformed_and_unsupported_requests(agent: Running) -> None:
    auth = {"Authorization": "Bearer op-token", "Content-Type": "application/json"}
    status, _, body = agent.raw("POST", "/v1/sessions/checkpoint", auth, b'{"sessionId": "x"}')
    assert status == 422
    assert "coordinator" in json.loads(body)["error"]
    status, _, body = agent.raw("POST", "/v1/sessions/checkpoint", auth, b"not json")
    assert status == 422
    status, _, _ = agent.raw("DELETE", "/v1/info", auth)
    assert status == 405
    status, _, _ = agent.raw("GET", "/v2/info", auth)
    assert status == 404
    restore = RestoreRequest.from_wire(
        {
            "sessionId": "r-1",
            "coordinator": "127.0.0.1:9",
            "sessionToken": "t",
            "job": "ring",
            "images": {
                "location": {"bucket": "ckpts", "credentialsSecretRef": {"name": "s3"}},
                "credentials": {"namespace": "ibckpt", "name": "s3"},
                "job": "ring",
                "checkpointId": "c1",
            },
        }
    )
    with pytest.raises(AgentError) as empty:
        agent.client().restore(restore)
    assert empty.value.status == 422
    assert "names no rank to restore" in empty.value.message


def test_the_session_token_reaches_the_wire_but_not_repr_or_a_plain_dump() -> None:
    request = _checkpoint("uid")
    assert b"session-secret" in request.to_json()
    assert "session-secret" not in repr(request)
    assert "session-secret" not in request.model_dump_json()
    assert CheckpointRequest.from_json(request.to_json()).session_token.get_secret_value() == "session-secret"


def test_an_aborts_replacement_coordinator_token_reaches_the_wire_but_not_repr() -> None:
    # the token of the coordinator a restarted operator opens for the recovery (a first version sent
    # the masked form, and the agents were refused by the new coordinator on the cluster)
    abort = AbortRequest(
        reason="operator restarted",
        coordinator="10.0.0.1:7000",
        session_token="recovery-secret",  # type: ignore[arg-type]
    )
    assert b"recovery-secret" in abort.to_json()
    assert "recovery-secret" not in repr(abort) and "recovery-secret" not in abort.model_dump_json()
    back = AbortRequest.from_json(abort.to_json())
    assert back.session_token is not None and back.session_token.get_secret_value() == "recovery-secret"
    assert b"sessionToken" not in AbortRequest(reason="no rejoin").to_json()


def test_the_info_names_the_shim_file_by_its_digest_and_follows_its_changes(agent: Running) -> None:
    """A checkpoint records it; a restore node with another shim build is refused (docs/upgrade.md)."""
    client = agent.client()
    assert client.info().shim_sha256 is None  # no shim installed yet
    shim = agent.server.shim_present_path
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_bytes(b"\x7fELF release 0.1")
    assert client.info().shim_sha256 == hashlib.sha256(b"\x7fELF release 0.1").hexdigest()
    replaced = shim.with_name("new.so")  # replaced as the installer does: a new file renamed into place
    replaced.write_bytes(b"\x7fELF release 0.2")
    replaced.rename(shim)
    assert client.info().shim_sha256 == hashlib.sha256(b"\x7fELF release 0.2").hexdigest()


def test_the_info_lists_every_shim_build_the_node_keeps_and_each_containers_build(
    agent: Running, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """The operator admits a restore on a node that keeps the build the checkpoint's processes mapped,
    and records for a checkpoint the build its containers map (docs/upgrade.md)."""
    from ibckpt_node.hook import install

    lib = tmp_path / "node-lib"
    lib.mkdir()
    digests = []
    for data in (b"\x7fELF release 0.1", b"\x7fELF release 0.2"):
        (tmp_path / "built.so").write_bytes(data)
        digests.append(install.install_shim(tmp_path / "built.so", lib))
    agent.server.shim_builds = lambda: install.installed_builds(lib)
    made = register(tmp_path / "state", sleeper.pid, "c1", shim_build=digests[0])
    try:
        info = agent.client().info()
        assert info.shim_builds == sorted(digests)
        [c] = info.containers
        assert c.shim_build == digests[0], "a pod started before the upgrade maps the older build"
    finally:
        for s in made:
            s.close()
