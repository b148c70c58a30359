"""A RestoreJob's destination pods, the half of its driver that deals with them: the Checkpoint's record
of each pod, where each goes (PlacePods), the checks on its node and name (AdmitNodes), its creation once
the images are staged, by this driver or by its own controller (CreatePods), and its deletion when the
restore is undone (CleanUpRestore). The agents' side is RestoreJobDriver's (restorejob.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ibckpt.agentapi import AgentError
from ibckpt.api import (
    API_VERSION,
    CHECKPOINT,
    RESTORE_JOB,
    Checkpoint,
    CheckpointPod,
    PodCreator,
    RestoreJobSpec,
)
from ibckpt_operator.cluster import bindings, sources, storage
from ibckpt_operator.cluster.agents import agents_by_node, agents_once_ready, each_agent, no_agent_message
from ibckpt_operator.cluster.kube import ApiException, Body, api_message
from ibckpt_operator.cluster.pods import node_ready, restore_marker
from ibckpt_operator.drivers import memorycopies
from ibckpt_operator.drivers.base import Driver, StepProblem
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine import RestoreState, memorytier
from ibckpt_operator.machine.actions import AdmitNodes, CleanUpRestore, CreatePods, PlacePods
from ibckpt_operator.machine.core import PodAdmitted, PodRefused, PodStepDone, StepFailed
from ibckpt_operator.machine.podtemplate import destination_pod
from ibckpt_operator.machine.restore import PodCreated, PodsPlaced
from ibckpt_operator.machine.restoreplan import (
    NodeFacts,
    NoNode,
    SourcePod,
    device_problems,
    incompatibilities,
    place_pods,
    unchecked,
)

log = logging.getLogger(__name__)
# A checkpointed source pod being deleted is waited for until this long before the admission bound.
SOURCE_WAIT_MARGIN_S = 10.0
SOURCE_POLL_S = 2.0


class RestorePodsDriver(Driver[RestoreState]):
    kind = RESTORE_JOB.kind
    plural = RESTORE_JOB.plural

    def __init__(self, runtime: Runtime, body: Body) -> None:
        super().__init__(runtime, body)
        self.spec = RestoreJobSpec.from_wire(body.get("spec") or {})
        self.uid: str = body["metadata"].get("uid") or ""
        self.checkpoint: Checkpoint | None = None
        self.by_controller = self.spec.pods_created_by == PodCreator.CONTROLLER

    # -- names and the Checkpoint's record

    def restored_by(self, run: str) -> str:
        """The annotation value that marks the pods this restore created (found by name after a restart)."""
        return f"{self.uid}/{run}"

    @property
    def checkpoint_ref(self) -> str:
        return f"{self.namespace}/{self.spec.checkpoint_name or ''}"

    async def load_checkpoint(self) -> Checkpoint | None:
        if self.checkpoint is None:
            name = self.spec.checkpoint_name or ""  # bound before the driver starts (handlers/restorejob.py)
            body = await self.rt.kube.get_custom(CHECKPOINT.plural, self.namespace, name)
            self.checkpoint = None if body is None else Checkpoint.from_wire(body)
        return self.checkpoint

    async def require_checkpoint(self) -> Checkpoint:
        """The Checkpoint a later step needs (read again after a restart); gone: the step fails."""
        checkpoint = await self.load_checkpoint()
        if checkpoint is None:
            raise StepProblem("CheckpointNotFound", f"Checkpoint {self.checkpoint_ref} does not exist")
        return checkpoint

    def recorded(self, name: str) -> CheckpointPod:
        assert self.checkpoint is not None
        return next(p for p in self.checkpoint.spec.pods or () if p.name == name)

    # -- where each pod goes, and whether it can

    async def place(self, action: PlacePods) -> None:
        checkpoint = await self.require_checkpoint()
        agents = await agents_by_node(self.rt.kube)
        wanted = dict(action.node_selector)
        candidates: dict[str, dict[str, str]] = {}
        for node in await self.rt.kube.list_nodes():
            name = node["metadata"]["name"]
            labels = node["metadata"].get("labels") or {}
            if name in action.avoid_nodes or not node_ready(node):
                continue
            if any(labels.get(key) != value for key, value in wanted.items()):
                continue
            if name in agents and agents[name].ready:
                candidates[name] = labels
        templates = {p.name: p.template for p in checkpoint.spec.pods or ()}
        sources = [
            SourcePod(
                pod.name,
                pod.node,
                (t.spec.get("nodeSelector") or {}) if (t := templates.get(pod.name)) else {},
            )
            for pod in action.pods
        ]
        try:
            placed = place_pods(sources, candidates, self.spec.avoid_source_nodes)
        except NoNode as error:
            self.emit(StepFailed(action.attempt, "NoNodeAvailable", str(error)))
            return
        self.emit(PodsPlaced(action.attempt, placed))

    async def admit(self, action: AdmitNodes) -> None:
        """Before anything is created: each destination has a ready agent and the versions the checkpoint
        requires, and no pod holds the name the restored pod must have."""
        checkpoint = await self.require_checkpoint()
        agents = await agents_once_ready(self.rt.kube, {p.node for p in action.pods}, self.agents_waited)
        kernels = {
            n["metadata"]["name"]: n.get("status", {}).get("nodeInfo", {}).get("kernelVersion")
            for n in await self.rt.kube.list_nodes()
        }
        blind = unchecked(checkpoint.spec.requires)
        if blind:
            message = f"the checkpoint requires {', '.join(blind)} versions that no node reports: not checked"
            await self.rt.kube.post_event(self.body, "Normal", "VersionsNotChecked", message)
        # every destination's agent asked at once; each pod is then judged in order as before
        asked = sorted({p.node for p in action.pods if p.node in agents and agents[p.node].ready})
        infos = dict(
            zip(asked, await each_agent([self.rt.gateway.info(agents[n]) for n in asked]), strict=True)
        )
        devices = await self.devices_used(checkpoint)
        for pod in action.pods:
            existing = await self.rt.kube.get_pod(self.namespace, pod.name)
            if existing is not None and await self.remove_ended_source(existing):
                existing = None
            if existing is not None and not self.by_controller and await self.source_went(existing):
                existing = None
            if existing is not None and not self.replaceable(existing):
                uid = existing["metadata"].get("uid")
                message = self.exists_message(pod.name, uid)
                self.emit(StepFailed(action.attempt, "PodExists", message, pod=pod.name))
                return
            agent = agents.get(pod.node)
            if agent is None or not agent.ready:
                self.emit(PodRefused(action.attempt, pod.name, no_agent_message(pod.name, pod.node, agent)))
                return
            info = infos[pod.node]
            if isinstance(info, AgentError):
                message = (
                    f"node {pod.node} for pod {pod.name} has an ibckpt agent that does not answer: {info}"
                )
                self.emit(PodRefused(action.attempt, pod.name, message))
                return
            reads = info.formats.reads if info.formats is not None else None
            facts = NodeFacts(
                ibckpt=info.version, kernel=kernels.get(pod.node), reads=reads, shim=info.shim_sha256,
                shim_builds=info.shim_builds, rdma_devices=info.rdma_devices,
            )  # fmt: skip
            problems = incompatibilities(checkpoint.spec.requires, facts)
            if problems:
                message = f"node {pod.node} cannot restore pod {pod.name}: {'; '.join(problems)}"
                self.emit(StepFailed(action.attempt, "IncompatibleNode", message, pod=pod.name))
                return
            unmapped = device_problems(devices.get(pod.name, {}), facts, self.spec.device_map)
            if unmapped:
                message = (
                    f"node {pod.node} cannot take the RDMA devices of pod {pod.name}: {'; '.join(unmapped)}"
                )
                self.emit(StepFailed(action.attempt, "DevicesDoNotFit", message, pod=pod.name))
                return
            self.emit(PodAdmitted(action.attempt, pod.name))

    async def devices_used(self, checkpoint: Checkpoint) -> dict[str, dict[str, list[str]]]:
        """The RDMA devices each checkpointed pod's containers used (pod -> its tree in the checkpoint ->
        the devices, each once), from the manifest; {} when it cannot be read: each node's agent then
        refuses a restore whose devices do not map, after the pods exist."""
        from ibckpt.store import CheckpointRef, StoreError

        spec = checkpoint.spec
        if not spec.job_name or not spec.checkpoint_id:
            return {}
        try:
            # resolved, not checked: opening the store makes the one request a check would
            location = await storage.location_of(self.rt.kube, self.namespace, spec.storage_ref, spec.storage)
            resolved = await storage.resolve(self.rt.kube, self.namespace, location)
            ref = CheckpointRef(spec.job_name, spec.checkpoint_id)
            if memorytier.checkpoint_on_s3(checkpoint):
                store = await asyncio.to_thread(storage.open_store, resolved.config)
                manifest = await asyncio.to_thread(store.manifest, ref)
            else:  # committed in memory: the manifest its holders keep, verified as S3's would be
                store = await asyncio.to_thread(storage.offline_store, resolved.config)
                manifest = store.manifest_from(ref, await self.held_manifest(checkpoint), "a holder's memory")
        except (StoreError, storage.StorageProblem, OSError, AgentError) as exc:
            log.warning("%s: the checkpoint's RDMA devices are not checked: %s", self.key, exc)
            return {}
        found: dict[str, dict[str, list[str]]] = {}
        for rank in manifest.ranks:
            if rank.pod and rank.devices is not None:
                used = (name for names in rank.devices.used.values() for name in names)
                found.setdefault(rank.pod, {})[rank.root.rsplit("/", 1)[-1]] = list(dict.fromkeys(used))
        return found

    async def held_manifest(self, checkpoint: Checkpoint) -> bytes:
        """The signed manifest of a checkpoint committed in memory, from the first holder that keeps it."""
        from ibckpt.store import StoreError

        held, agents = await memorycopies.held_now(self.rt, checkpoint)
        job, name = checkpoint.spec.job_name or "", checkpoint.spec.checkpoint_id or ""
        for holder in sorted({copy.node for copy in held}):
            with contextlib.suppress(AgentError):
                data = await self.rt.gateway.held_manifest(agents[holder], job, name)
                if data is not None:
                    return data
        raise StoreError(f"no ready holder keeps the manifest of {job}/{name} in memory")

    def replaceable(self, pod: Body) -> bool:
        """Controller mode: a source pod on its way out (its controller creates it again, bound here) or
        one this run bound already."""
        if not self.by_controller or self.state is None:
            return False
        meta = pod.get("metadata", {})
        if restore_marker(pod) == self.restored_by(self.state.run):
            return True
        return bool(meta.get("uid")) and self.source_uid(meta.get("name", "")) == meta.get("uid")

    def source_uid(self, name: str) -> str | None:
        """The uid the checkpoint recorded for its pod of this name."""
        recorded = self.checkpoint.spec.pods if self.checkpoint is not None else None
        return next((p.uid for p in recorded or () if p.name == name), None)

    async def remove_ended_source(self, pod: Body) -> bool:
        """The checkpointed pod of this name, deleted and ended, is removed now rather than after its
        node's cleanup (sources.py); True if it was."""
        name = pod.get("metadata", {}).get("name", "")
        uid = self.source_uid(name)
        if not uid or not await sources.remove_if_ended(self.rt.kube, self.namespace, pod, uid):
            return False
        await self.rt.kube.post_event(self.body, "Normal", "SourceRemoved", sources.removed_message(name))
        return True

    async def source_went(self, pod: Body) -> bool:
        """The checkpointed pod of this name is being deleted (a Stop checkpoint's kill, say): it goes by
        itself, so its name is waited for, within the admission bound, rather than refused. True once it
        is gone or removed (remove_ended_source); False if it stays, or another pod took its name."""
        meta = pod.get("metadata", {})
        name, uid = meta.get("name", ""), meta.get("uid")
        if not uid or uid != self.source_uid(name) or not meta.get("deletionTimestamp"):
            return False
        wait = max(0.0, self.spec.timeouts.admit_seconds - SOURCE_WAIT_MARGIN_S)
        message = f"pod {name} (uid {uid}), checkpointed, is being deleted: waiting up to {wait:.0f}s for it"
        await self.rt.kube.post_event(self.body, "Normal", "WaitingForSource", message)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            await asyncio.sleep(SOURCE_POLL_S)
            found = await self.rt.kube.get_pod(self.namespace, name)
            if found is None:
                return True
            if found.get("metadata", {}).get("uid") != uid:
                return False
            if await self.remove_ended_source(found):
                return True
        return False

    def exists_message(self, name: str, uid: str | None) -> str:
        if not self.by_controller:
            return (
                f"pod {name} already exists in namespace {self.namespace} (uid {uid}): the restore creates "
                "it under its original name, so delete the source pod first (and stop its controller from "
                "creating it again, or restore with podsCreatedBy: Controller)"
            )
        return (
            f"pod {name} (uid {uid}) is running in namespace {self.namespace} and is neither the "
            "checkpointed pod nor restored: its controller started it from scratch before this restore "
            "could bind it (was the operator's webhook unreachable?); delete it and its controller creates "
            "it again, restored"
        )

    # -- creating and deleting them

    async def create_pods(self, action: CreatePods) -> None:
        """Create the destination pods, once their images are staged on their nodes (DownloadImages is
        done): the runtime wrapper then finds them at once, and the agents restore the pods of these
        names."""
        assert self.state is not None
        await self.require_checkpoint()
        marker = self.restored_by(self.state.run)
        if self.by_controller:
            await self.adopt_pods(action, marker)
            return
        owner = {"apiVersion": API_VERSION, "kind": RESTORE_JOB.kind, "name": self.name, "uid": self.uid,
                 "controller": True}  # fmt: skip
        for pod in action.pods:
            template = self.recorded(pod.name).template
            assert template is not None  # resolve refused a checkpoint without one
            body = destination_pod(
                template,
                name=pod.name,
                namespace=self.namespace,
                node=pod.node,
                checkpoint=self.checkpoint_ref,
                restored_by=marker,
                owner=owner,
            )
            try:
                uid = await self.create_pod(body)
            except ApiException as error:
                if error.status != 409:
                    message = f"creating pod {pod.name} on {pod.node}: {api_message(error)}"
                    self.emit(StepFailed(action.attempt, "PodCreateFailed", message, pod=pod.name))
                    return
                existing = await self.rt.kube.get_pod(self.namespace, pod.name) or {}
                meta = existing.get("metadata", {})
                if restore_marker(existing) != marker:
                    message = f"pod {pod.name} was created by someone else meanwhile (uid {meta.get('uid')})"
                    self.emit(StepFailed(action.attempt, "PodExists", message, pod=pod.name))
                    return
                uid = str(meta["uid"])  # ours, from this run's attempt before
            log.info("%s: created pod %s (uid %s) on %s", self.key, pod.name, uid, pod.node)
            self.emit(PodCreated(action.attempt, pod.name, uid))

    async def adopt_pods(self, action: CreatePods, marker: str) -> None:
        """Controller mode: the images are staged, so the webhook now binds each member's new pod (claim);
        wake the controllers (they back off after the refusals) and wait for the pods they create."""
        workloads = {
            (t.controller.api_version or "", t.controller.kind, t.controller.name)
            for pod in action.pods
            if (t := self.recorded(pod.name).template) is not None and t.controller is not None
        }
        for api_version, kind, name in sorted(workloads):
            try:
                await self.rt.kube.annotate(
                    api_version, kind, self.namespace, name, {bindings.RESTORING: self.name}
                )
            except ApiException as error:  # a hint only: the controller retries by itself
                log.warning("%s: could not wake %s %s: %s", self.key, kind, name, api_message(error))
        waiting = {pod.name: pod for pod in action.pods}
        while waiting:
            for name, pod in list(waiting.items()):
                body = await self.rt.kube.get_pod(self.namespace, name) or {}
                meta = body.get("metadata", {})
                if restore_marker(body) == marker:
                    del waiting[name]
                    log.info(
                        "%s: %s created pod %s (uid %s) on %s",
                        self.key,
                        "its controller",
                        name,
                        meta["uid"],
                        pod.node,
                    )
                    self.emit(PodCreated(action.attempt, name, str(meta["uid"])))
                elif meta.get("uid") and await self.remove_ended_source(body):
                    continue  # its controller creates it again now, bound to this restore
                elif meta.get("uid") and not self.replaceable(body):
                    self.emit(
                        StepFailed(
                            action.attempt, "PodExists", self.exists_message(name, meta["uid"]), pod=name
                        )
                    )
                    return
            if waiting:
                await asyncio.sleep(1.0)

    async def create_pod(self, body: Body) -> str:
        return await self.rt.kube.create_pod(self.namespace, body)

    async def delete_created(self, action: CleanUpRestore) -> None:
        """Delete every pod this restore created: by uid when status has it, else by name if the pod
        carries this run's marker."""
        assert self.state is not None
        run = self.state.run
        for pod in action.pods:
            uid = pod.uid
            if not uid:
                body = await self.rt.kube.get_pod(self.namespace, pod.name) or {}
                meta = body.get("metadata", {})
                ours = restore_marker(body) == self.restored_by(run)
                uid = meta.get("uid", "") if ours else ""
            if uid:
                await self.rt.kube.delete_pod(self.namespace, pod.name, uid)
                log.info("%s: deleted pod %s (uid %s)", self.key, pod.name, uid)
            self.emit(PodStepDone(action.attempt, pod.name))
