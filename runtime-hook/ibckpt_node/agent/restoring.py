"""This node's part of a restore, in three steps:

1. stage: fetch each restored container's tree from the store (only this node's part of the
   checkpoint) into STATE_DIR/restore/NAMESPACE/POD/CONTAINER/images, then write staged.json last,
   so the runtime wrapper (hook/restore.py) finds either nothing or complete images. The operator
   creates the new pods only after this step (their uid is unknown until then);
2. the runtime restores: containerd creates the pod's container, the wrapper turns the create
   into `runc restore` from those images, and the hook registers the restored container;
3. rebuild: the agent finds each rank's control socket in the registered container and the
   driver rebuilds and resumes them with the peers (NodeDriver.rebuild_restored).

`run` is the agent's restore session through these steps; `download` is its first.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ibckpt.agentapi import Milestone
from ibckpt.agentapi import models as api
from ibckpt.coordination.client import CoordinationAborted, CoordinatorError
from ibckpt.coordination.ranks import RankId
from ibckpt_node import driver, itimers, preflight, tcp_remap
from ibckpt_node.agent import restoredevices
from ibckpt_node.agent.kubesecrets import StagingError
from ibckpt_node.agent.session import (
    Agent,
    Session,
    coordinated,
    finish_failed,
    host_pid,
    passed,
    set_phase,
    shim_channels,
)
from ibckpt_node.errors import CheckpointFailed
from ibckpt_node.hook import oci
from ibckpt_node.hook.restore import criu_errors
from ibckpt_node.ranks import LocalRank
from ibckpt_node.registry import ContainerRegistry, RegisteredContainer
from ibckpt_node.trees import SHIM_BUILD, TREE_MANIFEST

if TYPE_CHECKING:  # the store (boto3) is imported only when a restore stages
    from ibckpt.store import ManifestKeys, StoreConfig
    from ibckpt.store.manifest import ContainerDevices, Manifest
    from ibckpt_node.agent.memorycopies import CopyReader

log = logging.getLogger(__name__)

POLL_S = 0.25


class RestoreError(Exception):
    """This node cannot restore what it was asked to; the message says why."""


class RestoreRefused(RestoreError):
    """Refused before anything was staged: the images would not fit on this node."""


@dataclass(frozen=True)
class ContainerRestore:
    """One container to restore here: the new pod's, and the tree of the checkpointed one."""

    pod_uid: str  # empty: the pod does not exist yet (the one of this name created after staging)
    namespace: str
    pod: str
    container: str
    tree_root: str  # the container's directory in the checkpoint, e.g. node-1/job-0.main
    rank_keys: tuple[str, ...]
    devices: ContainerDevices | None = None  # what the checkpoint recorded (None: nothing)


def plan(request: api.RestoreRequest, manifest: Manifest) -> list[ContainerRestore]:
    """Which checkpointed tree each requested container is restored from."""
    if not request.checkpoint:
        raise RestoreError("the restore request names no checkpoint (the new pods' restore annotation)")
    grouped: dict[tuple[str, str, str], list[api.RestoreRank]] = {}
    for rank in request.ranks:
        if not rank.namespace or not rank.pod:
            raise RestoreError(f"rank {rank.rank_key}: the request does not name its new pod")
        try:  # they name the staging directory
            for name in (rank.namespace, rank.pod, rank.container):
                oci.checked_id(name)
        except ValueError as exc:
            raise RestoreError(f"rank {rank.rank_key}: {exc}") from None
        grouped.setdefault((rank.namespace, rank.pod, rank.container), []).append(rank)
    roots = {r.root for r in manifest.ranks if r.root}
    planned = []
    for (_, _, container), ranks in grouped.items():
        source = RankId.parse(ranks[0].rank_key)
        # a checkpointed container's tree is <its node>/<pod>.<container> (sessions.py names it)
        wanted = f"{source.pod}.{source.container}"
        found = sorted(root for root in roots if root.rsplit("/", 1)[-1] == wanted)
        if len(found) != 1:
            raise RestoreError(
                f"checkpoint {request.checkpoint} has {len(found)} trees for {source.pod} container "
                f"{source.container} ({', '.join(found) or 'none'}); expected one"
            )
        planned.append(
            ContainerRestore(
                ranks[0].pod_uid,
                ranks[0].namespace,
                ranks[0].pod,
                container,
                found[0],
                tuple(r.rank_key for r in ranks),
                next((r.devices for r in manifest.ranks if r.root == found[0]), None),
            )
        )
    return planned


def recorded_devices(
    planned: Sequence[ContainerRestore], uids: dict[str, str]
) -> list[restoredevices.Recorded]:
    """What each planned container's checkpoint recorded of its devices, with the restored pod's uid
    (`uids`: rank key -> uid, as wait_for_ranks found them)."""
    return [
        restoredevices.Recorded(
            f"{item.namespace}/{item.pod} container {item.container}",
            uids.get(item.rank_keys[0], item.pod_uid),
            item.container,
            tuple(item.devices.allocated),
            item.devices.used,
        )
        for item in planned
        if item.devices is not None and item.rank_keys
    ]


def check_room(
    manifest: Manifest,
    planned: Sequence[ContainerRestore],
    restore_dir: Callable[[str, str, str], str],
) -> None:
    """RestoreRefused when the planned containers' images would not fit where they are staged, by the
    checkpoint's rules (preflight.restore_room_problem)."""
    if not planned:
        return
    dirs = [restore_dir(item.namespace, item.pod, item.container) for item in planned]
    staging = Path(os.path.commonpath(dirs))
    try:
        problem = preflight.restore_room_problem(
            manifest.files, [item.tree_root for item in planned], staging
        )
    except OSError as exc:  # not known to be short: the download says so if it is
        log.warning("the room for a restore in %s is unknown: %s", staging, exc)
        return
    if problem:
        raise RestoreRefused(problem)


def _private_dir(path: Path) -> None:
    """Root's alone (the agent runs as root): the wrapper refuses anything else."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)


def stage(
    config: StoreConfig,
    source: api.ImageSource,
    checkpoint: str,
    planned: Sequence[ContainerRestore],
    restore_dir: Callable[[str, str, str], str],
    progress: Callable[[int], None],
    remap: tcp_remap.AddressMap | None = None,
    lock: tcp_remap.ConnectionLock | None = None,
    stop: threading.Event | None = None,
    *,
    keys: ManifestKeys,
    copies: CopyReader | None = None,
    manifest: Manifest | None = None,
) -> int:
    """Fetch and stage every planned container's images; returns the bytes fetched. `keys`: the image key
    set the manifest must verify with (the agent always gives it). `manifest`: the checkpoint's, read from
    the memory tier and verified: then every chunk comes from `copies` and S3 is not used at all.

    `stop` set: the session is over (a thread cannot be cancelled, so a download past its bound or
    aborted goes on here): nothing more is staged or held, and what this call staged is removed.

    Before a container's staged.json is written, its images' TCP sockets are rewritten by `remap` (a
    hostNetwork pod's node addresses, old -> new, the same map on every node) and its established
    connections are added to `lock`: their packets are dropped until every node has restored (see
    tcp_remap.py), so a restored end does not meet a peer node that answers with a reset."""
    from ibckpt.store import ImageStore
    from ibckpt.store.errors import StoreError
    from ibckpt.store.layout import CheckpointRef

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    ref = CheckpointRef(source.job, source.checkpoint_id)
    total = 0
    memory_only = manifest is not None
    item: ContainerRestore | None = None
    try:
        store = (
            ImageStore.offline(config, signing=keys) if memory_only else ImageStore.open(config, signing=keys)
        )
        for item in planned:
            if stopped():
                break
            where = Path(restore_dir(item.namespace, item.pod, item.container))
            try:
                if where.exists():
                    shutil.rmtree(where)  # a retried session: start from nothing
                for level in (where.parents[2], where.parents[1], where.parent, where):
                    _private_dir(level)
                report = store.restore(
                    ref, where / "images", progress=progress, subtree=item.tree_root, chunk_source=copies,
                    manifest=manifest, source_only=memory_only,
                )  # fmt: skip
                total += report.logical_bytes
                if copies is not None:
                    copies.tally(report)
                (where / "images").chmod(0o700)
                restore_args, shim_build = _from_tree_manifest(where / "images")
                prepared = tcp_remap.prepare_images(where / "images", remap or {})
                if stopped():  # the session let its held connections go: hold no more
                    break
                if lock is not None:
                    lock.extend(prepared.connections)
                staged = {
                    "checkpoint": checkpoint,
                    "namespace": item.namespace,
                    "pod": item.pod,
                    "pod_uid": item.pod_uid,
                    "container": item.container,
                    "restore_args": restore_args,
                }
                if shim_build is not None:  # a checkpoint from before builds were kept has none
                    staged["shim_build"] = shim_build
                partial = where / "staged.json.partial"
                partial.write_text(json.dumps(staged) + "\n")
                partial.chmod(0o600)
                partial.rename(where / "staged.json")  # last: the wrapper waits for this file
            finally:
                if stopped():  # the session ended meanwhile, and may have unstaged before this was
                    unstage([item], restore_dir)
    except StoreError as exc:
        if memory_only and item is not None:
            part = item.tree_root.split("/", 1)[0]  # a node's part: <node>/<pod>.<container>
            held = [s.node for s, _ in copies.copies if s.part == part] if copies is not None else []
            holders = f"held by {', '.join(held)}" if held else "which no holder was named for"
            raise StagingError(f"restoring {ref} from memory alone: part {part}, {holders}: {exc}") from exc
        raise StagingError(f"fetching {ref} from {config.where()}: {exc}") from exc
    except tcp_remap.RemapError as exc:
        raise RestoreError(f"moving the TCP connections in the images of {checkpoint}: {exc}") from exc
    return total


def _from_tree_manifest(images: Path) -> tuple[str, str | None]:
    """(runc restore options, the shim build its processes mapped or None) of a container's images."""
    try:
        manifest = json.loads((images / TREE_MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise RestoreError(f"{images}: no tree manifest ({exc}): not a container checkpoint") from None
    if manifest.get("runtime") != "runc":
        raise RestoreError(f"{images}: dumped without the container runtime: the runtime cannot restore it")
    build = manifest.get(SHIM_BUILD)
    if build is not None and not (isinstance(build, str) and oci.is_build_digest(build)):
        raise RestoreError(f"{images}: {SHIM_BUILD} {build!r} is not a shim build")
    return str(manifest.get("restore_args", "")), build


def restore_errors(
    planned: Sequence[ContainerRestore], restore_dir: Callable[[str, str, str], str]
) -> list[str]:
    """What CRIU said of each planned container's failed `runc restore`, read before the staging is
    removed (the wrapper reports the same to containerd)."""
    found = []
    for item in planned:
        said = criu_errors(str(Path(restore_dir(item.namespace, item.pod, item.container), "images")))
        if said:
            found.append(f"runc restore of {item.pod}/{item.container}: {said}")
    return found


def unstage(planned: Sequence[ContainerRestore], restore_dir: Callable[[str, str, str], str]) -> None:
    for item in planned:
        where = Path(restore_dir(item.namespace, item.pod, item.container))
        shutil.rmtree(where, ignore_errors=True)
        for parent in (where.parent, where.parents[1]):  # the pod's and namespace's, once empty
            try:
                parent.rmdir()
            except OSError:
                break


def _restored_entry(
    registry: ContainerRegistry, item: ContainerRestore, staged_at: float
) -> RegisteredContainer | None:
    """The container the runtime restored for `item`: by uid when the request named one, else the
    one of that pod name registered after its images were staged (an older one is not ours)."""
    for entry in registry.entries():
        if not entry.shim or entry.container != item.container:
            continue
        if item.pod_uid:
            if entry.pod_uid == item.pod_uid:
                return entry
        elif (entry.namespace, entry.pod) == (item.namespace, item.pod) and entry.registered_at >= staged_at:
            return entry
    return None


async def wait_for_ranks(
    registry: ContainerRegistry,
    planned: Sequence[ContainerRestore],
    host_pid: Callable[[int, int], int],
    timeout_s: float,
    staged_at: float = 0.0,
    pod_uids: dict[str, str] | None = None,
) -> list[LocalRank]:
    """The restored ranks, once the runtime has restored every planned container and each rank's
    control socket is back (a plain container's key waits for its container only); RestoreError naming
    what is missing when `timeout_s` passes. Each rank's pod uid goes into `pod_uids` (rank key -> uid)
    as its container is found."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks: list[LocalRank] = []
        missing: list[str] = []
        for item in planned:
            entry = _restored_entry(registry, item, staged_at)
            if entry is None:
                missing.append(f"{item.namespace}/{item.pod} container {item.container} (not restored yet)")
                continue
            if pod_uids is not None:
                pod_uids.update(dict.fromkeys(item.rank_keys, entry.pod_uid))
            sockets = {Path(p).name: p for p in entry.sockets()}
            for key in item.rank_keys:
                if RankId.parse(key).plain:  # restored as it was dumped: nothing to rebuild
                    continue
                process = RankId.parse(key).process
                path = sockets.get(f"{process}.sock")
                if path is None:
                    missing.append(f"{key} (no control socket in the restored container)")
                    continue
                first = Path(entry.control_socket).name == f"{process}.sock"
                pid = entry.pid if first else host_pid(entry.pid, int(process))
                ranks.append(LocalRank(RankId.parse(key), pid, Path(path)))
        if not missing:
            return ranks
        if time.monotonic() >= deadline:
            raise RestoreError(f"not restored within {timeout_s:g}s: {'; '.join(missing)}")
        await asyncio.sleep(POLL_S)


async def run(agent: Agent, session: Session) -> None:
    request = session.request
    assert isinstance(request, api.RestoreRequest)
    report = session.report
    planned: list[ContainerRestore] = []
    restore_dir = agent.registry.config.restore_dir
    lock = tcp_remap.ConnectionLock([])  # the restored TCP connections, held until every node restored
    stop = threading.Event()  # the session is over: a download still running stages nothing more
    try:
        # A container of these pods registered before is not the restored one. Taken before the download:
        # the operator may create the pods while the last bytes arrive (machine/restore.py, "Overlap").
        staged_at = time.time()
        await download(agent, session, request, lock, planned, stop)
        async with coordinated(agent, session) as (client, proxy):
            session.engine = engine = driver.NodeDriver(
                agent.node,
                client,
                [],
                timeouts=request.timeouts.seconds(),
                flush_records=proxy.published,
                confine=proxy.confine,
                on_milestone=functools.partial(passed, session),
            )
            passed(session, Milestone.DOWNLOADED)

            async def restored() -> list[LocalRank]:
                uids: dict[str, str] = {}
                ranks = await wait_for_ranks(
                    agent.registry,
                    planned,
                    host_pid,
                    request.timeouts.restore_seconds,
                    staged_at,
                    uids,
                )
                await proxy.add(shim_channels(ranks))  # before any rebuild asks for records
                await restoredevices.apply(  # each rank's device map, before any rank rebuilds
                    recorded_devices(planned, uids),
                    agent.registry.entries(),
                    ranks,
                    request.device_map,
                    request.timeouts.quiesce_seconds,
                )
                if await asyncio.to_thread(itimers.criu_drops_one_shots):  # armed again (itimers.py)
                    for item in planned:
                        where = Path(restore_dir(item.namespace, item.pod, item.container), "images")
                        engine.itimer_images.update(dict.fromkeys(item.rank_keys, where))
                for r in ranks:
                    session.by_key[r.rank.key()].pid = r.pid
                for key, uid in uids.items():  # plain containers' entries too
                    session.by_key[key].pod_uid = uid
                return ranks

            result = await session.engine.rebuild_restored(restored, request.epoch, lock)
        report.phases = dict(result.phases)
        set_phase(session, api.RankPhase.DONE)
        report.state = api.SessionState.SUCCEEDED
        report.phase = "Succeeded"
        report.message = f"restored {len(planned)} containers on {agent.node}"
    except RestoreRefused as exc:
        finish_failed(session, api.SessionState.REFUSED, str(exc))
    except (StagingError, RestoreError, restoredevices.DeviceRestoreError) as exc:
        finish_failed(session, api.SessionState.FAILED, str(exc))
    except CoordinationAborted as exc:
        finish_failed(session, api.SessionState.ABORTED, str(exc))
    except (CheckpointFailed, CoordinatorError, OSError) as exc:
        state = api.SessionState.ABORTED if session.abort_reason else api.SessionState.FAILED
        finish_failed(session, state, str(exc))
    except asyncio.CancelledError:
        finish_failed(session, api.SessionState.ABORTED, session.abort_reason or "cancelled")
    except Exception as exc:
        log.exception("session %s", request.session_id)
        finish_failed(session, api.SessionState.FAILED, f"agent error: {exc}")
    finally:
        stop.set()  # first: a download still running holds no more connections, stages nothing more
        for error in await asyncio.to_thread(lock.unlock):  # a failed restore lets them go too
            log.error("session %s: %s", request.session_id, error)
        if report.state is not api.SessionState.SUCCEEDED:
            failed = await asyncio.to_thread(restore_errors, planned, restore_dir)
            for line in failed:
                log.error("session %s: %s", request.session_id, line)
            if failed:
                report.message = f"{report.message}; {'; '.join(failed)}"[:4000]
        # staged images are used once (the restored container has read them) or not at all; a failed
        # or aborted download's are removed too (`planned` is known before anything is staged)
        # off the loop: a large pod's pages take seconds to remove, and the probes wait on the loop
        await asyncio.to_thread(unstage, planned, restore_dir)
        report.finished_at = time.time()
        log.info(
            "session %s: %s (%s) %s", request.session_id, report.state.value, report.phase, report.message
        )
        agent.on_finished(report)


async def download(
    agent: Agent,
    session: Session,
    request: api.RestoreRequest,
    lock: tcp_remap.ConnectionLock,
    planned: list[ContainerRestore],
    stop: threading.Event,
) -> None:
    """Read the checkpoint's manifest, plan this node's containers (into `planned`, before anything is
    staged, so that the caller removes what a failed download staged) and stage their images."""
    from ibckpt.store import ImageStore, StoreError  # boto3: only when staging
    from ibckpt.store.layout import CheckpointRef
    from ibckpt_node.agent import memorycopies
    from ibckpt_node.agent.staging import image_keys, read_config

    if agent.secrets is None:
        raise StagingError("this agent has no way to read Secrets")
    source = request.images
    config = await read_config(agent.secrets, source.location, source.credentials, agent.work_dir / "ca")
    ref = CheckpointRef(source.job, source.checkpoint_id)
    keys = image_keys(agent.image_keys)

    copies = memorycopies.reader_for(request, agent.memory_token_file, agent.coordinator_tls, agent)
    if request.memory_only and copies is None:
        raise StagingError(f"a restore of {ref} from memory alone, and no memory copy to read (or no token)")

    def read_manifest():  # type: ignore[no-untyped-def]
        # Verified here, before anything is planned or written; stage() verifies again what it fetches.
        if request.memory_only:  # the holders' copy, verified as S3's would be; S3 is not asked
            assert copies is not None
            try:
                return memorycopies.read_manifest(ImageStore.offline(config, signing=keys), ref, copies)
            except StoreError as exc:
                raise StagingError(f"reading {ref} from memory alone: {exc}") from exc
        try:
            return ImageStore.open(config, signing=keys).manifest(ref)
        except StoreError as exc:
            raise StagingError(f"reading {ref} from {config.where()}: {exc}") from exc

    try:
        remap = tcp_remap.parse_map([f"{old}={new}" for old, new in request.remap_ip.items()])
    except ValueError as exc:
        raise RestoreError(f"the restore request's address map: {exc}") from None
    manifest = await asyncio.to_thread(read_manifest)
    planned[:] = plan(request, manifest)
    restore_dir = agent.registry.config.restore_dir
    await asyncio.to_thread(check_room, manifest, planned, restore_dir)
    planned_bytes = preflight.restore_bytes(manifest.files, [item.tree_root for item in planned])
    staging_progress = api.StagingProgress(bytes_planned=planned_bytes)
    session.report.staging = staging_progress
    started = time.monotonic()
    count_lock = threading.Lock()

    def count(size: int) -> None:  # runs on the download's threads; the report reads it as it is
        with count_lock:
            staging_progress.bytes_done += size
            staging_progress.seconds = round(time.monotonic() - started, 3)

    staging = asyncio.to_thread(
        stage,
        config,
        source,
        request.checkpoint,
        planned,
        restore_dir,
        count,
        remap,
        lock,
        stop,
        keys=keys,
        copies=copies,
        manifest=manifest if request.memory_only else None,
    )
    try:
        session.report.bytes = await asyncio.wait_for(staging, request.timeouts.download_seconds)
    except TimeoutError:
        raise StagingError(f"download did not finish within {request.timeouts.download_seconds:g}s") from None
    finally:  # a failed download's reads from memory are reported too
        if copies is not None:
            session.report.memory_copy = copies.report()
    for item in planned:
        for key in item.rank_keys:
            session.by_key[key].bytes = session.report.bytes // max(1, len(session.report.ranks))
    session.report.phases[Milestone.DOWNLOADED] = round(time.monotonic() - started, 3)
    if remap or lock.connections:
        log.info(
            "session %s: addresses remapped %s; TCP connections held until every node restored: %s",
            request.session_id,
            ", ".join(f"{a}={b}" for a, b in remap.items()) or "none",
            ", ".join(c.describe() for c in lock.connections) or "none",
        )
