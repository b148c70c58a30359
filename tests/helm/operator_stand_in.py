"""What the operator does for one node's checkpoint or restore, run in a pod with the product image.

The tests feed this file to `python3 -` in a pod on the pod network, with a CONFIG line first (the
tokens and keys travel on stdin, never on a command line). It hosts the job's coordinator on the pod's
address, drives one node agent through its API with the operator's token (ibckpt.agentapi, as the
operator does), and for a checkpoint commits the node's staged part in the store. A restore, as the
operator's, asks the agent first and creates the new pod (with the operator's token) once the agent
has staged its images. It prints one line, `RESULT <json>`, with the agent's final report.
"""

import asyncio
import json
import os
import socket
import ssl
import tempfile
import time
import urllib.request
from typing import Any

from pydantic import SecretStr

from ibckpt.agentapi import (
    AgentClient,
    CheckpointRequest,
    ImageDestination,
    ImageSource,
    Mode,
    PhaseTimeouts,
    RankRef,
    RestoreRank,
    RestoreRequest,
    SecretRef,
)

cfg: Any = json.loads(globals()["CONFIG"])  # the first line the test sends


def pod_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((cfg["agent"], 9))
        return str(s.getsockname()[0])


def create_pod(manifest: dict[str, Any]) -> str:
    """POST the pod to the apiserver (in-cluster address, the operator's token); its uid."""
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    namespace = manifest["metadata"]["namespace"]
    with tempfile.NamedTemporaryFile("w", suffix=".crt") as ca:
        ca.write(cfg["api_ca"])
        ca.flush()
        context = ssl.create_default_context(cafile=ca.name)
    request = urllib.request.Request(
        f"https://{host}:{port}/api/v1/namespaces/{namespace}/pods",
        data=json.dumps(manifest).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {cfg['token']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60, context=context) as reply:
        return str(json.load(reply)["metadata"]["uid"])


async def main() -> dict[str, Any]:
    agent = AgentClient(cfg["agent"], cfg["port"], token=cfg["token"], timeout_s=60)
    if cfg["action"] == "containers":
        return (await asyncio.to_thread(agent.containers)).to_wire()
    # imported only here: each import costs seconds in an emulated node
    from ibckpt.api.storage import S3Location
    from ibckpt.store import ImageStore
    from ibckpt_node.agent.staging import store_config
    from ibckpt_operator.coordinator.server import CoordinatorServer

    server = CoordinatorServer(pod_ip(), 0)
    await server.start()
    session_id, token = server.create_session({cfg["node"]}, 900)
    location = S3Location.model_validate(cfg["location"])
    secret = SecretRef(namespace=cfg["secret_namespace"], name=cfg["secret_name"])
    coordinator = f"{server.host}:{server.port}"
    timeouts = PhaseTimeouts(restore_seconds=300, rebuild_seconds=120)
    store_job, checkpoint_id = cfg["store_job"], cfg["checkpoint_id"]
    started = time.monotonic()
    if cfg["action"] == "checkpoint":
        checkpoint = CheckpointRequest(
            session_id=session_id,
            coordinator=coordinator,
            session_token=SecretStr(token),
            timeouts=timeouts,
            job=cfg["job"],
            mode=Mode(cfg["mode"]),
            ranks=[RankRef(pod_uid=cfg["pod_uid"], container="main")],
            images=ImageDestination(
                location=location, credentials=secret, job=store_job, checkpoint_id=checkpoint_id
            ),
        )
        await asyncio.to_thread(agent.checkpoint, checkpoint)
    else:
        restore = RestoreRequest(
            session_id=session_id,
            coordinator=coordinator,
            session_token=SecretStr(token),
            timeouts=timeouts,
            job=cfg["job"],
            checkpoint=cfg["checkpoint"],
            images=ImageSource(
                location=location, credentials=secret, job=store_job, checkpoint_id=checkpoint_id
            ),
            ranks=[
                RestoreRank(
                    container="main",
                    rank_key=key,
                    namespace=cfg["namespace"],
                    pod=cfg["pod"],
                )
                for key in cfg["rank_keys"]
            ],
        )
        await asyncio.to_thread(agent.restore, restore)
    created = None
    while True:
        report = await asyncio.to_thread(agent.session, session_id)
        if report.state.finished:
            break
        staged = report.ranks and all(r.phase.value not in ("Pending", "Downloading") for r in report.ranks)
        if cfg["action"] == "restore" and created is None and staged:
            created = await asyncio.to_thread(create_pod, cfg["create"])
        await asyncio.sleep(0.5)
    seconds = time.monotonic() - started
    committed = None
    if cfg["action"] == "checkpoint" and report.state.value == "Succeeded":
        store = ImageStore.open(store_config(location, secret, cfg["secret_data"]))
        manifest = await asyncio.to_thread(store.commit_parts, store_job, checkpoint_id, [cfg["node"]])
        committed = {"id": manifest.ref.checkpoint_id, "bytes": manifest.stats.logical_bytes}
    await server.stop()
    return {"report": report.to_wire(), "seconds": seconds, "committed": committed, "created": created}


print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
