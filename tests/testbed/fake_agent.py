"""A fake ibckpt node agent for the operator's tests: the agent API (ibckpt.agentapi) over HTTP on
127.0.0.x, walking its ranks through the real agent's phases and milestones, and staging a checkpoint's
part in the real S3 so the operator's commit is real (the cluster tests use the real agent)."""

from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ibckpt.agentapi import (
    BUSY_STATUS,
    AgentFormats,
    AgentInfo,
    CheckpointRequest,
    ContainerList,
    MemoryCopyReport,
    Milestone,
    Mode,
    RankPhase,
    RankProgress,
    RegisteredContainer,
    RestoreRequest,
    SessionKind,
    SessionReport,
    SessionState,
    StagingProgress,
    agent_audience,
)
from ibckpt.agentapi.memory import COPIES, MANIFESTS, MemorySeal
from ibckpt.store import CheckpointRef, ImageStore, ManifestKeys, RankInfo, StoreConfig
from ibckpt.vocabulary import GATED
from ibckpt_node.agent import memoryroutes
from ibckpt_node.agent.memorytier import MemoryShelf

# Whose tokens the fake agents take: the operator's account in the test apiserver (tests/operator).
OPERATOR_SUBJECT = "system:serviceaccount:ibckpt-system:ibckpt-operator"
# Each fake agent's memory tier, by its address: the real agent's shelf and routes, so that what the
# operator lists and drops is what the fake agents "sent" to each other.
SHELVES: dict[str, MemoryShelf] = {}
SHELF_BYTES = 64 * 1024 * 1024


def token_claims(token: str) -> dict[str, Any]:
    """A service-account token's claims, unverified: the fake agent checks what the operator asked the
    apiserver for (the real agent has the apiserver review it)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return claims if isinstance(claims, dict) else {}


@dataclass
class FakeAgent:
    """One node's agent API. `behaviour`: "hang" keeps every rank quiescing; "complete" walks the ranks
    through every phase and stages this node's part in the real S3 (so the operator's commit is real).
    A restore session goes in the real agent's order: it reads the checkpoint's manifest from the real S3,
    "stages" (ranks Restoring), then waits for the operator to create the pods of the requested names
    (with the restore annotation) and takes their uids, and walks the ranks to Done; `download_failure`
    fails it while downloading, `restore_failure` once the pods exist, `restore_hang` waits there."""

    node: str
    host: str
    port: int
    behaviour: str = "hang"
    store: StoreConfig | None = None
    signing: ManifestKeys | None = None  # the image keys, as the chart mounts them into agents
    containers: list[RegisteredContainer] = field(default_factory=list)
    requests: list[CheckpointRequest] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    rejoins: list[str | None] = field(default_factory=list)  # each abort's replacement coordinator
    reports: dict[str, SessionReport] = field(default_factory=dict)
    server: ThreadingHTTPServer | None = None
    restores: list[RestoreRequest] = field(default_factory=list)
    restore_failure: str | None = None
    restore_hang: bool = False  # stay Restoring (the runtime never restored the container)
    busy_with: str | None = None  # another job's session runs here: new ones are refused as busy
    download_failure: str | None = None
    # a download this long, its progress reported as the real agent's (StagingProgress); each report's
    # time and whether every requested pod existed then go into `staging_seen`
    staging_seconds: float = 0.0
    staging_seen: list[tuple[float, bool]] = field(default_factory=list)
    # namespace, pod name -> (uid, restore-from annotation) of the pod of that name, or None
    pod_lookup: Callable[[str, str], tuple[str, str] | None] | None = None
    pods_at_request: list[list[str]] = field(default_factory=list)  # per restore: its pods that existed
    # replaced mid-abort: the first abort of a session is accepted and then the agent "restarts" (the
    # session is unknown to its polls); its successor, holding the session's record, takes the next
    replaced_mid_abort: bool = False
    records: dict[str, SessionReport] = field(default_factory=dict)
    version: str = "test"
    # what it writes and reads, as a real agent of this release reports it; None: an agent before formats
    formats: AgentFormats | None = field(default_factory=AgentFormats.this_release)
    shim_sha256: str | None = None  # the node's shim build, as a real agent reports it
    shim_builds: list[str] = field(default_factory=list)  # every build it keeps (empty: the current one)
    rdma_devices: list[str] | None = None  # its node's HCAs, as /v1/info reports them (None: not reported)
    tls: ssl.SSLContext | None = None  # what it serves with, as a real agent: the operator's certificate
    tokens: list[dict[str, Any]] = field(default_factory=list)  # each call's token's claims
    # commitOn Memory (MemoryCopyTarget.first): the S3 upload after the copy waits for this to be set
    # (None: at once), and `upload_failure` then fails the session as a failed upload does
    upload_gate: threading.Event | None = None
    upload_failure: str | None = None
    # commitOn S3: the copy is made before the session's last report, as a real agent's small part is kept
    # before the operator's next poll sees its session end (False: half a second after that report)
    copy_in_last_report: bool = False

    def register(
        self, pod: dict[str, Any], namespace: str, container: str = "main", shim_build: str | None = None
    ) -> None:
        """A container under the shim; it maps `shim_build`, by default the node's current build."""
        self.containers.append(
            RegisteredContainer(
                container_id=secrets.token_hex(8),
                namespace=namespace,
                pod=pod["name"],
                pod_uid=pod["uid"],
                container=container,
                pid=4242,
                control_socket="/run/ibckpt/ctl/4242.sock",
                shim=True,
                shim_build=shim_build or self.shim_sha256,
            )
        )

    @property
    def shelf(self) -> MemoryShelf:
        return SHELVES.setdefault(f"{self.host}:{self.port}", MemoryShelf(self.node, SHELF_BYTES))

    def restart_shelf(self) -> None:
        """As an agent restarted: what it held for the others is gone."""
        SHELVES.pop(f"{self.host}:{self.port}", None)

    def start(self) -> None:
        agent = self
        self.restart_shelf()
        _ = self.shelf  # an empty one, which the others' copies reach by this agent's address

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: bytes | memoryview) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def authorized(self) -> bool:
                scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                claims = token_claims(token) if scheme == "Bearer" else {}
                agent.tokens.append(claims)
                if claims.get("aud") != [agent_audience(agent.node)] or claims.get("sub") != OPERATOR_SUBJECT:
                    self.reply(401, b'{"error": "unauthorized"}')
                    return False
                return True

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self.reply(200, b"ok")
                    return
                if not self.authorized():
                    return
                if self.path == "/v1/info":
                    builds = agent.shim_builds or ([agent.shim_sha256] if agent.shim_sha256 else [])
                    info = AgentInfo(node=agent.node, version=agent.version, ready=True,
                                     address=f"{agent.host}:1", shim_path="/opt/ibckpt/libibckpt.so",
                                     shim_present=True, containers=agent.containers,
                                     formats=agent.formats, shim_sha256=agent.shim_sha256,
                                     shim_builds=builds, rdma_devices=agent.rdma_devices)  # fmt: skip
                    self.reply(200, info.to_json())
                elif self.path == "/v1/containers":
                    self.reply(200, ContainerList(node=agent.node, containers=agent.containers).to_json())
                elif self.path.startswith((COPIES, MANIFESTS)):  # as the real agent routes them
                    self.memory("GET")
                elif self.path.startswith("/v1/sessions/"):
                    report = agent.reports.get(self.path.rsplit("/", 1)[1])
                    if report is None:
                        self.reply(404, b'{"error": "unknown session"}')
                    else:
                        self.reply(200, report.to_json())
                else:
                    self.reply(404, b'{"error": "no such path"}')

            def do_DELETE(self) -> None:
                if self.authorized():
                    self.memory("DELETE")

            def do_PUT(self) -> None:  # the operator hands a holder a checkpoint's manifest
                if self.authorized():
                    self.memory("PUT", self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def memory(self, method: str, body: bytes = b"") -> None:
                answer = memoryroutes.handle(agent.shelf, method, self.path, body)
                self.reply(answer.status, answer.body)

            def do_POST(self) -> None:
                if not self.authorized():
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if agent.busy_with and self.path in ("/v1/sessions/checkpoint", "/v1/sessions/restore"):
                    refusal = {"error": f"{agent.node} is busy with session {agent.busy_with!r}"}
                    self.reply(BUSY_STATUS, json.dumps(refusal).encode())
                    return
                if self.path == "/v1/sessions/checkpoint":
                    request = CheckpointRequest.from_json(body)
                    agent.requests.append(request)
                    report = agent.new_report(request)
                    self.reply(202, report.to_json())
                    if agent.behaviour == "complete":
                        threading.Thread(target=agent.complete, args=(request,), daemon=True).start()
                    elif agent.behaviour == "refuse":
                        agent.refuse(request)
                elif self.path == "/v1/sessions/restore":
                    restore = RestoreRequest.from_json(body)
                    agent.restores.append(restore)
                    agent.pods_at_request.append(
                        sorted({r.pod for r in restore.ranks if agent.find_pod(r.namespace, r.pod)})
                    )
                    report = agent.new_restore_report(restore)
                    self.reply(202, report.to_json())
                    threading.Thread(target=agent.restore, args=(restore,), daemon=True).start()
                elif self.path.endswith("/abort"):
                    session = self.path.split("/")[3]
                    agent.aborts.append((session, json.loads(body)["reason"]))
                    agent.rejoins.append(json.loads(body).get("coordinator"))
                    running = agent.reports.get(session) or agent.records.pop(session, None)
                    if running is None:
                        self.reply(404, b'{"error": "unknown session"}')
                        return
                    if agent.replaced_mid_abort and len(agent.aborts) == 1:
                        agent.records[session] = agent.reports.pop(session)
                        self.reply(200, running.to_json())  # accepted, still running: then gone
                        return
                    ranks = [r.model_copy(update={"phase": RankPhase.DONE}) for r in running.ranks]
                    done = running.model_copy(update={"state": SessionState.ABORTED, "ranks": ranks,
                                                     "finished_at": time.time()})  # fmt: skip
                    agent.reports[session] = done
                    self.reply(200, done.to_json())
                else:
                    self.reply(404, b'{"error": "no such path"}')

        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        if self.tls is not None:  # each accepted connection does its handshake in the serving thread
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _holder(self, request: CheckpointRequest) -> tuple[MemoryShelf | None, MemoryCopyReport]:
        """The holder's shelf (None: not reachable, which the report then says) and an empty report."""
        assert request.memory_copy is not None
        holder = SHELVES.get(request.memory_copy.address)
        report = MemoryCopyReport(node=request.memory_copy.node, part=self.node)
        if holder is None:
            report.message = f"not kept on {request.memory_copy.node}: not reachable"
        return holder, report

    def keep_copy(self, request: CheckpointRequest) -> MemoryCopyReport:
        """This node's part "sent" to the holder's shelf as one chunk of 200 kB, sealed."""
        assert request.memory_copy is not None and request.images is not None
        holder, report = self._holder(request)
        if holder is None:
            return report
        key = (request.images.job, request.images.checkpoint_id, self.node)
        holder.put_piece(key, 0, bytes(200_000))
        held = holder.seal(key, MemorySeal(chunks={"0" * 64: (0, 200_000)}, bytes=200_000))
        report.kept, report.chunks, report.bytes, report.seconds = True, held.chunks, held.bytes, 0.1
        return report

    def keep_first(self, request: CheckpointRequest, images: Path) -> MemoryCopyReport:
        """commitOn Memory: this node's part sealed on the holder's shelf, chunks and signed part manifest
        as the real agent's keep_first sends them, before the S3 upload."""
        assert request.memory_copy is not None and request.images is not None and self.store is not None
        holder, report = self._holder(request)
        if holder is None:
            return report
        key = (request.images.job, request.images.checkpoint_id, self.node)
        sealed: dict[str, bytes] = {}
        store = ImageStore.offline(self.store.for_codec(request.images.codec), signing=self.signing)
        with store.sealer(request.images.job, request.images.checkpoint_id, sealed.__setitem__) as writer:
            writer.add_tree(images, under=self.node)
            part = writer.sealed_part(self.node, [self.rank_info()])
        data, chunks = b"", {}
        for cid, stored in sealed.items():
            chunks[cid] = (len(data), len(stored))
            data += stored
        holder.put_piece(key, 0, data)
        seal = MemorySeal(chunks=chunks, bytes=len(data), manifest=bytes(part.data).decode())
        held = holder.seal(key, seal)
        report.kept, report.chunks, report.bytes, report.seconds = True, held.chunks, held.bytes, 0.1
        return report

    def rank_info(self) -> RankInfo:
        return RankInfo(rank=int(self.host.rsplit(".", 1)[1]), pod=self.node, node=self.node, root=self.node)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def new_report(self, request: CheckpointRequest) -> SessionReport:
        ranks = [
            RankProgress(rank_key=f"{request.job}/{r.pod_uid}/{r.container}/0", pod_uid=r.pod_uid,
                         container=r.container, pid=4242, phase=RankPhase.QUIESCING, done=Milestone.ADMITTED)
            for r in request.ranks
        ]  # fmt: skip
        report = SessionReport(session_id=request.session_id, kind=SessionKind.CHECKPOINT, node=self.node,
                               phase="quiesce", ranks=ranks, started_at=time.time())  # fmt: skip
        self.reports[request.session_id] = report
        return report

    def new_restore_report(self, request: RestoreRequest) -> SessionReport:
        ranks = [
            RankProgress(
                rank_key=r.rank_key, pod_uid=r.pod_uid, container=r.container, phase=RankPhase.DOWNLOADING
            )
            for r in request.ranks
        ]
        report = SessionReport(session_id=request.session_id, kind=SessionKind.RESTORE, node=self.node,
                               phase="Downloading", ranks=ranks, started_at=time.time())  # fmt: skip
        self.reports[request.session_id] = report
        return report

    def restore(self, request: RestoreRequest) -> None:
        session = request.session_id
        try:
            assert self.store is not None
            if request.memory_only:  # as the real agent: the signed manifest from a holder, no S3 call
                held = [SHELVES[c.address].manifest(request.images.job, request.images.checkpoint_id)
                        for c in request.memory_copies or () if c.address in SHELVES]  # fmt: skip
                if not any(held):
                    raise LookupError("no holder keeps the checkpoint's manifest")
            else:
                ImageStore.open(self.store, signing=self.signing).manifest(
                    CheckpointRef(request.images.job, request.images.checkpoint_id)
                )
        except Exception as error:
            self.set_phase(session, RankPhase.FAILED, state=SessionState.FAILED, finished_at=time.time(),
                           message=f"{self.node}: reading the manifest: {error}")  # fmt: skip
            return
        time.sleep(0.2)
        if self.reports[session].state.finished:  # aborted meanwhile
            return
        if self.download_failure:
            self.set_phase(session, RankPhase.FAILED, state=SessionState.FAILED, finished_at=time.time(),
                           message=self.download_failure)  # fmt: skip
            return
        if self.staging_seconds and not self.stage_slowly(request):
            return
        self.set_phase(session, RankPhase.RESTORING, Milestone.DOWNLOADED, bytes=1000)  # the pods are next
        if not self.wait_for_pods(request):
            return
        if self.restore_hang:
            return
        for phase, done in (
            (RankPhase.REBUILDING, Milestone.RESTORED),
            (RankPhase.RESUMING, Milestone.REBUILT),
        ):
            time.sleep(0.2)
            if self.reports[session].state.finished:  # aborted meanwhile
                return
            if self.restore_failure and phase == RankPhase.REBUILDING:
                self.set_phase(session, RankPhase.FAILED, state=SessionState.FAILED, finished_at=time.time(),
                               message=self.restore_failure)  # fmt: skip
                return
            self.set_phase(session, phase, done)
        time.sleep(0.2)
        # as the real agent reports chunks it read from memory copies: one per copy named, here
        copies = request.memory_copies or []
        read = copies and MemoryCopyReport(
            node=",".join(c.node for c in copies), part=",".join(c.part for c in copies), kept=True,
            chunks=len(copies), bytes=1000 * len(copies),
        )  # fmt: skip
        self.set_phase(session, RankPhase.DONE, Milestone.RESUMED, state=SessionState.SUCCEEDED,
                       finished_at=time.time(), memory_copy=read or None)  # fmt: skip

    def stage_slowly(self, request: RestoreRequest) -> bool:
        """1000 bytes over staging_seconds, the progress in the report; False if aborted meanwhile."""
        session, began, planned = request.session_id, time.monotonic(), 1000
        while True:
            seconds = min(time.monotonic() - began, self.staging_seconds)
            done = int(planned * seconds / self.staging_seconds)
            progress = StagingProgress(bytes_done=done, bytes_planned=planned, seconds=round(seconds, 3))
            report = self.reports[session]
            if report.state.finished:
                return False
            self.reports[session] = report.model_copy(update={"staging": progress})
            pods = [self.find_pod(r.namespace, r.pod) for r in request.ranks]
            self.staging_seen.append((seconds, all(pods)))
            if done >= planned:
                return True
            time.sleep(0.2)

    def find_pod(self, namespace: str, name: str) -> tuple[str, str] | None:
        return self.pod_lookup(namespace, name) if self.pod_lookup is not None else None

    def wait_for_pods(self, request: RestoreRequest) -> bool:
        """As the real agent: the pods of the requested names, created with the restore annotation after
        staging; their uids go into the report. False if aborted meanwhile or never created."""
        session = request.session_id
        deadline = time.monotonic() + min(request.timeouts.restore_seconds, 60)
        while True:
            report = self.reports[session]
            if report.state.finished:
                return False
            found = {(r.namespace, r.pod): self.find_pod(r.namespace, r.pod) for r in request.ranks}
            uids = {key: pod[0] for key, pod in found.items() if pod and pod[1] == request.checkpoint}
            if len(uids) == len(found):
                by_key = {r.rank_key: uids[(r.namespace, r.pod)] for r in request.ranks}
                ranks = [r.model_copy(update={"pod_uid": by_key.get(r.rank_key, r.pod_uid)})
                         for r in report.ranks]  # fmt: skip
                self.reports[session] = report.model_copy(update={"ranks": ranks})
                return True
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(f"{ns}/{pod}" for (ns, pod) in set(found) - set(uids)))
                self.set_phase(session, RankPhase.FAILED, state=SessionState.FAILED, finished_at=time.time(),
                               message=f"{self.node}: pods never created: {missing}")  # fmt: skip
                return False
            time.sleep(0.2)

    def first_request(self, timeout: float = 10.0) -> CheckpointRequest:
        """The first checkpoint request, once it came: the operator writes the step to status first, then
        calls the agent, so a phase seen in status does not mean the call was made."""
        deadline = time.monotonic() + timeout
        while not self.requests:
            assert time.monotonic() < deadline, f"the agent on {self.node} was never asked"
            time.sleep(0.05)
        return self.requests[0]

    def set_phase(
        self, session: str, phase: RankPhase, done: Milestone | None = None, **changes: Any
    ) -> None:
        """Every rank in `phase`, past `done` (None: the milestone it had)."""
        report = self.reports[session]
        ranks = [
            r.model_copy(
                update={"phase": phase, "done": done or r.done, "bytes": changes.pop("bytes", r.bytes)}
            )
            for r in report.ranks
        ]  # the bytes, if given, go to the first rank
        self.reports[session] = report.model_copy(update={"ranks": ranks, **changes})

    def refuse(self, request: CheckpointRequest) -> None:
        """What the real agent's preflight says of a rank holding something it cannot save."""
        rank = request.ranks[0]
        message = (f"{self.node}: refusing to checkpoint {request.job}/{rank.container} (pid 4242): "
                   "unsupported verb ibv_alloc_dm")  # fmt: skip
        self.set_phase(request.session_id, RankPhase.DONE, state=SessionState.REFUSED, message=message,
                       finished_at=time.time())  # fmt: skip

    def complete(self, request: CheckpointRequest) -> None:
        """The real agent's order: the cut, the dump, (LeaveRunning) rebuild and resume, then the upload
        of this node's part; the session succeeds only once the part is staged."""
        session = request.session_id
        phases = [(RankPhase.DRAINING, Milestone.QUIESCED), (RankPhase.RELEASING, Milestone.DRAINED),
                  (RankPhase.DUMPING, Milestone.RELEASED)]  # fmt: skip
        if request.mode == Mode.HOLD:
            phases += [(RankPhase.UPLOADING, Milestone.DUMPED)]
        else:
            phases += [(RankPhase.REBUILDING, Milestone.DUMPED), (RankPhase.RESUMING, Milestone.REBUILT),
                       (RankPhase.UPLOADING, Milestone.RESUMED)]  # fmt: skip
        took: dict[str, float] = {}  # as the real agent's report: seconds per finished phase
        for phase, done in phases:
            time.sleep(0.2)
            took[done] = 0.2
            self.set_phase(session, phase, done, phases=dict(took))
        if request.mode == Mode.LEAVE_RUNNING:  # the node's own measure: its Resumed barrier not counted
            took[GATED] = 1.1
        upload_started = time.monotonic()
        assert self.store is not None and request.images is not None
        images = Path(f"/tmp/ibckpt-fake-agent-{self.node}-{secrets.token_hex(3)}")
        images.mkdir()
        (images / "pages-1.img").write_bytes(os.urandom(200_000))
        first = request.memory_copy is not None and request.memory_copy.first
        kept = None
        if first:  # the copy and its signed part before the upload (commitOn Memory)
            kept = self.keep_first(request, images)
            if kept.kept:
                took[Milestone.MEMORY_KEPT] = 0.1
            self.set_phase(session, RankPhase.UPLOADING, phases=dict(took), memory_copy=kept)
            if self.upload_gate is not None:
                self.upload_gate.wait(60)
            if self.upload_failure is not None:
                self.set_phase(session, RankPhase.FAILED, state=SessionState.FAILED,
                               message=self.upload_failure, finished_at=time.time())  # fmt: skip
                return
            upload_started = time.monotonic()
        # as the real agent's staging: the job's compression decides the level
        store = ImageStore.open(self.store.for_codec(request.images.codec), signing=self.signing)
        with store.writer(request.images.job, request.images.checkpoint_id) as writer:
            writer.add_tree(images, under=self.node)
            writer.stage(self.node, ranks=[self.rank_info()])
        final = (RankPhase.HELD, Milestone.UPLOADED) if request.mode == Mode.HOLD else (RankPhase.DONE, None)
        took[Milestone.UPLOADED] = round(time.monotonic() - upload_started, 3)
        if not first and request.memory_copy is not None and self.copy_in_last_report:
            kept = self.keep_copy(request)
        self.set_phase(session, *final, bytes=200_000, state=SessionState.SUCCEEDED, finished_at=time.time(),
                       phases=took, memory_copy=kept or None)  # fmt: skip
        # the memory tier, commitOn S3: as the real agent, the part goes to the named agent once the session
        # has reported (the operator lists it once the holder has it sealed)
        if not first and request.memory_copy is not None and not self.copy_in_last_report:
            time.sleep(0.5)  # after the operator has seen the report: it cannot count on the copy being there
            self.set_phase(session, *final, memory_copy=self.keep_copy(request))
