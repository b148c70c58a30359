"""A CheckpointJob's spec and names, and the half of its driver that deals with the image store and the
Checkpoint it publishes: the storage check, the commit of the nodes' staged parts (CommitManifest), its
verification after a restart (VerifyManifest), the commit on the memory tier (CommitInMemory: the parts'
manifests their holders keep, merged and handed back to them; S3 follows in the background, durable.py),
the discard of an aborted attempt's parts (DiscardUpload), and the Checkpoint itself (PublishCheckpoint).
The pods and the agents are CheckpointJobDriver's (checkpointjob.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from datetime import UTC, datetime

from ibckpt.agentapi import CHECKPOINT_MILESTONES, AgentError, MemoryCopyReport, Milestone
from ibckpt.api import (
    CHECKPOINT,
    CHECKPOINT_JOB,
    Checkpoint,
    CheckpointJobSpec,
    CheckpointMode,
    CheckpointSize,
    CheckpointSpec,
    CheckpointStatus,
    CheckpointTimings,
    CheckpointUpload,
    JobReference,
    ObjectMeta,
    StorageTier,
    UploadState,
)
from ibckpt.store.units import format_size
from ibckpt_operator import metrics
from ibckpt_operator.cluster import storage
from ibckpt_operator.cluster.agents import each_agent, ready_agents
from ibckpt_operator.cluster.imports import RECORD_LABEL, restore_record
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.drivers import durable, memorycopies
from ibckpt_operator.drivers.base import Driver, StepProblem
from ibckpt_operator.drivers.progress import PodProgress
from ibckpt_operator.drivers.recording import RestoreRecord
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import CheckpointMachine, JobState, memorytier
from ibckpt_operator.machine.actions import (
    CommitInMemory,
    CommitManifest,
    DiscardUpload,
    PublishCheckpoint,
    VerifyManifest,
)
from ibckpt_operator.machine.checkpoint import CheckpointPublished, ManifestCommitted, ManifestMissing
from ibckpt_operator.machine.timings import checkpoint_timings, commit_seconds

log = logging.getLogger(__name__)


def job_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


class CheckpointStoreDriver(Driver[JobState]):
    kind = CHECKPOINT_JOB.kind
    plural = CHECKPOINT_JOB.plural

    def __init__(self, runtime: Runtime, body: Body) -> None:
        super().__init__(runtime, body)
        self.spec = CheckpointJobSpec.from_wire(body.get("spec") or {})
        self.machine: CheckpointMachine | None = None
        # By pod UID. The agent rebuilds and resumes a LeaveRunning job before it uploads its part, so
        # past the dump only the finished session says the part is uploaded.
        final = Milestone.UPLOADED if self.spec.mode == CheckpointMode.STOP else Milestone.RESUMED
        self.progress = PodProgress(
            CHECKPOINT_MILESTONES, final, until=Milestone.DUMPED, count_zero_bytes=True
        )
        self.resolved: storage.ResolvedStorage | None = None
        self.record = RestoreRecord()  # what a restore needs, written into the Checkpoint
        self.node_phases: dict[str, dict[str, float]] = {}  # each node's last SessionReport.phases
        # each node's SessionReport.memoryCopy (the memory tier): in memory only, so a Checkpoint
        # published by a restarted operator says S3 only, which is true of what it can vouch for
        self.memory_reports: dict[str, MemoryCopyReport] = {}
        # each node's buddy, as the requests named it: with a commit on S3 the copies are made after the
        # sessions reported, and the Checkpoint lists them once their holders have them sealed
        self.memory_holders: dict[str, str] = {}
        self.memory_labels: dict[str, str] = {}  # the restore record the memory commit signed
        self.upload_deadline = datetime.now(UTC)  # status.upload.deadline, set when published in memory

    def timings(self, state: JobState, now: float) -> CheckpointTimings | None:
        """From the nodes' reports; the total runs from the job's start to its end (or to `now`)."""
        end = state.finished_at if state.finished_at is not None else now
        leave_running = self.spec.mode != CheckpointMode.STOP
        timings = checkpoint_timings(self.node_phases, leave_running, end - state.started_at)
        committed = commit_seconds(state.phase_spans, state.phase, state.phase_since)
        if timings is None or committed is None:
            return timings
        return timings.model_copy(update={"commit_seconds": committed})

    # -- names

    def checkpoint_name(self, run: str) -> str:
        return self.spec.checkpoint_name or f"{self.name}-{run}"

    @property
    def store_job(self) -> str:
        """The job's name in the store: the workload's, so its checkpoints are listed (and kept) together."""
        workload = self.spec.workload_ref.name if self.spec.workload_ref else self.name
        return f"{self.namespace}/{workload}"

    @property
    def rank_job(self) -> str:
        """The job in rank keys (job/pod/container/process): one name, no namespace, so no slash."""
        return self.spec.workload_ref.name if self.spec.workload_ref else self.name

    @staticmethod
    def session_id(state: JobState) -> str:
        """Each session the job opens has its own id: the agents keep the ids they served."""
        return f"ckj-{state.run}" + (f"-{state.session_turn}" if state.session_turn else "")

    def machine_checkpoint_name(self) -> str:
        assert self.machine is not None
        return self.machine.config.checkpoint_name

    # -- the store and the Checkpoint

    async def store(self) -> storage.ResolvedStorage:
        if self.resolved is None:
            self.resolved = await storage.check(
                self.rt.kube, self.namespace, self.spec.storage_ref, self.spec.storage
            )
        return self.resolved

    async def commit(self, action: CommitManifest) -> None:
        resolved = await self.store()
        assert self.state is not None
        # Each agent stages its part under its node's name: the commit refuses a set missing one.
        expected = sorted({m.pod.node for m in self.state.members})
        image_store = await asyncio.to_thread(storage.open_store, resolved.config)
        from ibckpt.store import CheckpointRef

        # what a Checkpoint object needs, signed with the manifest: `kubectl ibckpt import` makes it again
        ref = CheckpointRef(self.store_job, action.checkpoint_name)
        labels = await self.record_labels(
            action.checkpoint_name, image_store.context.layout.manifest_key(ref)
        )
        manifest = await asyncio.to_thread(
            functools.partial(
                image_store.commit_parts, self.store_job, action.checkpoint_name, expected, labels=labels
            )
        )
        metrics.CHECKPOINT_BYTES.inc(manifest.stats.logical_bytes)
        key = image_store.context.layout.manifest_key(manifest.ref)
        self.emit(ManifestCommitted(action.attempt, key))

    async def record_labels(self, checkpoint_name: str, manifest_key: str) -> dict[str, str]:
        """What a Checkpoint object needs, signed with the manifest (`kubectl ibckpt import`)."""
        spec = await self.checkpoint_spec(checkpoint_name, manifest_key)
        return {RECORD_LABEL: restore_record(spec, self.copied_labels())}

    async def commit_in_memory(self, action: CommitInMemory) -> None:
        """commitOn Memory: each part's signed manifest from its holder, merged and signed for the bucket
        key (parts.commit_in_memory, no S3), then handed to every holder of the job's parts, which keep it
        beside their copies: a restore reads it there."""
        from ibckpt.store import CheckpointRef
        from ibckpt.store.parts import commit_in_memory

        assert self.state is not None
        resolved = await self.store()
        expected = sorted({m.pod.node for m in self.state.members})
        holders = {node: self.memory_reports[node].node for node in expected if node in self.memory_reports}
        agents = await ready_agents(self.rt.kube)
        if lost := sorted(node for node in expected if holders.get(node) not in agents):
            message = f"no ready holder keeps the part of {', '.join(lost)} in memory"
            raise StepProblem("MemoryCopyLost", message)
        job, name = self.store_job, action.checkpoint_name
        answers = await each_agent(
            [self.rt.gateway.part_manifest(agents[holders[n]], job, name, n) for n in expected]
        )
        held: dict[str, bytes] = {}
        for node, answer in zip(expected, answers, strict=True):
            if isinstance(answer, AgentError) or answer is None:
                why = answer if isinstance(answer, AgentError) else "it keeps no sealed copy"
                raise StepProblem("MemoryCopyLost", f"the part of {node} on {holders[node]}: {why}")
            held[node] = answer
        image_store = await asyncio.to_thread(storage.offline_store, resolved.config)
        key = image_store.context.layout.manifest_key(CheckpointRef(job, name))
        self.memory_labels = await self.record_labels(name, key)
        commit = functools.partial(
            commit_in_memory, image_store.context, job, name, held, expected, labels=self.memory_labels
        )
        manifest, data = await asyncio.to_thread(commit)
        keepers = sorted(set(holders.values()))
        given = await each_agent([self.rt.gateway.put_manifest(agents[n], job, name, data) for n in keepers])
        if refused := [f"{n}: {a}" for n, a in zip(keepers, given, strict=True) if isinstance(a, AgentError)]:
            # a holder without the manifest could not serve a restore of the memory tier alone
            raise StepProblem("MemoryCommitFailed", f"the manifest was not kept by {'; '.join(refused)}")
        metrics.CHECKPOINT_BYTES.inc(manifest.stats.logical_bytes)
        self.emit(ManifestCommitted(action.attempt, key, StorageTier.MEMORY))

    async def verify(self, action: VerifyManifest) -> None:
        resolved = await self.store()
        image_store = await asyncio.to_thread(storage.open_store, resolved.config)
        from ibckpt.store import CheckpointNotFoundError, CheckpointRef

        ref = CheckpointRef(self.store_job, action.checkpoint_name)
        try:
            await asyncio.to_thread(image_store.manifest, ref)
        except CheckpointNotFoundError:
            self.emit(ManifestMissing(action.attempt))
            return
        self.emit(ManifestCommitted(action.attempt, image_store.context.layout.manifest_key(ref)))

    async def discard(self, action: DiscardUpload) -> None:
        """Drop the aborted attempt's staged parts. It shares the resume's attempt but not its outcome: a
        store that cannot be reached (often why the upload failed) must not end the abort before the
        ranks are back, so a failure is told, never fed to the machine; nothing lists staged parts, and
        the store's garbage collection removes abandoned ones."""
        try:
            resolved = await self.store()
            image_store = await asyncio.to_thread(storage.open_store, resolved.config)
            dropped = await asyncio.to_thread(image_store.abort, self.store_job, action.checkpoint_name)
        except Exception as error:
            message = (
                f"the parts staged for checkpoint {action.checkpoint_name} were not discarded ({error}); "
                "no Checkpoint lists them, and the store's garbage collection removes abandoned parts"
            )
            log.warning("%s: %s", self.key, message)
            with contextlib.suppress(Exception):
                await self.rt.kube.post_event(self.body, "Warning", "PartsNotDiscarded", message)
            return
        log.info("%s: dropped %d staged part(s) of %s", self.key, dropped, action.checkpoint_name)

    async def checkpoint_spec(self, checkpoint_name: str, manifest_key: str) -> CheckpointSpec:
        """The Checkpoint's spec, as of now: at the commit (its restore record) and at the publish."""
        assert self.state is not None
        members = self.state.members
        total = sum(self.progress.bytes.get(m.pod.uid, m.bytes or 0) for m in members)
        return CheckpointSpec(
            job_name=self.store_job,
            checkpoint_job_ref=JobReference(name=self.name, uid=self.body["metadata"].get("uid")),
            source=self.spec.workload_ref,
            checkpoint_id=checkpoint_name,
            storage_ref=self.spec.storage_ref,
            storage=self.spec.storage,
            manifest_key=manifest_key,
            mode=self.spec.mode,
            pods=await self.record.pods(self.rt, self.namespace, members, self.session_id(self.state)),
            rank_count=sum(len(keys) for keys in self.record.rank_keys.values()),
            requires=await self.record.requires(self.rt, members),
            nodes=sorted({m.pod.node for m in members if m.pod.node}),
            size=CheckpointSize(bytes=total, human=format_size(total)),
            timings=self.timings(self.state, time.time()),
        )

    async def publish(self, action: PublishCheckpoint) -> None:
        spec = await self.checkpoint_spec(action.checkpoint_name, action.manifest_key)
        labels = self.copied_labels()
        checkpoint = Checkpoint(
            metadata=ObjectMeta(name=action.checkpoint_name, namespace=self.namespace, labels=labels or None),
            spec=spec,
        )
        created = await self.rt.kube.create_custom(CHECKPOINT.plural, self.namespace, checkpoint.to_wire())
        if created:
            copies = memorytier.kept_copies(self.memory_reports)
            upload = self.spec.timeouts.upload_seconds
            # what a restarted operator needs to take the S3 commit up again (durable.resume)
            self.upload_deadline = durable.deadline_after(upload, datetime.now(UTC))
            status = CheckpointStatus(
                ready_to_restore=True,
                tiers=memorytier.tiers(copies, spec.nodes or [], on_s3=not action.in_memory),
                memory_copies=copies or None,
                message=f"committed in memory; the S3 upload is in progress (within {upload}s)"
                if action.in_memory
                else None,
                upload=CheckpointUpload(state=UploadState.IN_PROGRESS, deadline=self.upload_deadline)
                if action.in_memory
                else None,
            )
            with contextlib.suppress(Exception):
                await self.rt.kube.patch_status(
                    CHECKPOINT.plural, self.namespace, action.checkpoint_name, status.to_wire()
                )
            try:  # advice only: a restore asks the holders what they keep
                await memorycopies.forget_replaced(
                    self.rt, self.namespace, self.store_job, action.checkpoint_name, copies
                )
            except Exception as error:
                log.warning("%s: older Checkpoints' memory copies not updated: %s", self.key, error)
            if action.in_memory:
                await self.upload_in_background(action.checkpoint_name, spec.nodes or [])
            elif memorytier.missing_parts(copies, self.memory_holders):
                # some copies were not in the sessions' reports yet: watch them all (a fast node's copy
                # can be, and the others' then were never listed)
                holders, bound = dict(self.memory_holders), float(self.spec.timeouts.upload_seconds)
                watch = memorycopies.record_when_sealed(
                    self.rt, self.namespace, action.checkpoint_name, self.store_job, holders, bound
                )
                self.rt.detach(watch, f"memory copies {self.key}")
        self.emit(CheckpointPublished(action.attempt))

    async def upload_in_background(self, checkpoint_name: str, parts: list[str]) -> None:
        """After a commit on the memory tier: merge the S3 parts once staged (durable.py)."""
        resolved = await self.store()
        upload = durable.Upload(
            namespace=self.namespace, name=checkpoint_name, job=self.store_job, checkpoint_id=checkpoint_name,
            parts=tuple(parts), labels=self.memory_labels, config=resolved.config,
            deadline=self.upload_deadline, bound_seconds=float(self.spec.timeouts.upload_seconds),
        )  # fmt: skip
        self.rt.detach(durable.commit_when_uploaded(self.rt, upload), f"s3 commit {self.key}")

    def copied_labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.body["metadata"].get("labels") or {}
        keys = self.spec.copy_labels or []
        if "*" in keys:
            return dict(labels)
        return {key: labels[key] for key in keys if key in labels}
