"""A RestoreJob with `latestOf`: before its driver starts, the newest restorable Checkpoint of the group
is chosen (machine/latest.py) and written into its spec.checkpointName, once, as a claim's volumeName is
bound; the newer ones passed over go to status.skippedCheckpoints, and an Event says what was chosen.
A restarted operator finds the name bound and restores that one."""

from __future__ import annotations

import logging

from ibckpt.api import CHECKPOINT, RESTORE_JOB, Checkpoint, RestoreJob
from ibckpt_operator.cluster.kube import Body
from ibckpt_operator.cluster.schedules import list_namespaced
from ibckpt_operator.drivers.runtime import Runtime
from ibckpt_operator.machine.latest import choose_latest, describe

log = logging.getLogger(__name__)


async def bind_latest(rt: Runtime, body: Body) -> str | None:
    """Bind `body` (a RestoreJob, updated in place) to its latest restorable Checkpoint; the reason
    when there is none. A RestoreJob that names its Checkpoint, or whose spec is invalid, is left alone."""
    spec = body.get("spec") or {}
    if spec.get("checkpointName") or not spec.get("latestOf"):
        return None
    try:
        latest = RestoreJob.from_wire(body).spec.latest_of
    except ValueError:
        return None  # the job's daemon fails it as invalid
    assert latest is not None
    meta = body["metadata"]
    namespace, name, key = meta["namespace"], meta["name"], f"{meta['namespace']}/{meta['name']}"
    checkpoints: list[Checkpoint] = []
    for item in await list_namespaced(rt.kube, CHECKPOINT.plural, namespace):
        try:
            checkpoints.append(Checkpoint.from_wire(item))
        except ValueError as error:  # written by hand or by another version: not a candidate
            log.warning("%s: Checkpoint %s is unreadable: %s", key, item["metadata"].get("name"), error)
    choice = choose_latest(checkpoints, namespace, latest)
    skipped = [{"name": n, "reason": why} for n, why in choice.skipped]
    if skipped:
        await rt.kube.patch_status(RESTORE_JOB.plural, namespace, name, {"skippedCheckpoints": skipped})
        body.setdefault("status", {})["skippedCheckpoints"] = skipped  # the driver keeps it
    group = describe(latest)
    if choice.name is None:
        if not choice.considered:
            return f"no Checkpoint of {group} exists in namespace {namespace}"
        return (
            f"none of the {choice.considered} Checkpoint(s) of {group} can be restored "
            f"(status.skippedCheckpoints says why): {choice.skipped[0][0]}: {choice.skipped[0][1]}"
        )
    await rt.kube.patch_custom(RESTORE_JOB.plural, namespace, name, {"spec": {"checkpointName": choice.name}})
    body["spec"]["checkpointName"] = choice.name
    message = f"restoring Checkpoint {choice.name}, the newest restorable one of {group}"
    if skipped:
        message += f"; passed over the newer {', '.join(s['name'] for s in skipped)}"
    log.info("%s: %s", key, message)
    await rt.kube.post_event(body, "Normal", "CheckpointChosen", message)
    return None
