"""RestoreJob: one daemon per job drives it (restorejob.RestoreJobDriver) from its status; and the
mutating webhook that binds a controller's new pod to the node its restore staged (bindings.py)."""

from __future__ import annotations

import copy
from typing import Any

import kopf

from ibckpt.api import GROUP, RESTORE_JOB, VERSION, RestorePhase
from ibckpt_operator.cluster import admission, bindings
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.latest import bind_latest
from ibckpt_operator.drivers.restorejob import RestoreJobDriver
from ibckpt_operator.handlers.jobs import drive_job, fail_invalid

ENDED = (RestorePhase.SUCCEEDED, RestorePhase.FAILED)


# A deleted job first brings its ranks back (bounded by its abort timeout); an exiting operator leaves at
# once (the state is in status). kopf cancels the daemon only past these bounds.
@kopf.daemon(GROUP, VERSION, RESTORE_JOB.plural, cancellation_backoff=2.0, cancellation_timeout=600.0)
async def drive(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    raw = copy.deepcopy(dict(body))
    if (raw.get("status") or {}).get("phase") not in ENDED:
        problem = await bind_latest(runtime.get(), raw)  # latestOf: the Checkpoint is chosen first
        if problem is not None:
            await fail_invalid(
                runtime.get(), raw, RESTORE_JOB.plural, problem, reason="NoRestorableCheckpoint"
            )
            return
    await drive_job(raw, stopped, RESTORE_JOB.plural, RestoreJobDriver, ENDED)


# failurePolicy Ignore: a dead operator must not block every pod creation in the cluster (a pod it
# would have bound then starts from scratch; the Checkpoint stays restorable).
@kopf.on.mutate("v1", "pods", operations=["CREATE"], ignore_failures=True, id=admission.RESTORE_BINDING)
async def bind_restored_pod(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    claim = bindings.answer(dict(body))
    if isinstance(claim, bindings.Waiting):
        raise kopf.AdmissionError(claim.message, code=429)
    if isinstance(claim, bindings.Binding):
        for section, fields in bindings.merge_patch(claim).items():
            patch.setdefault(section, {}).update(fields)
