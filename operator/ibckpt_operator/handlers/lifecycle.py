"""Start-up and clean-up: the Lease first (no handler runs before this replica holds it), then metrics,
the internal TLS Secrets, the coordinator, and the pod claims rebuilt from every CheckpointJob's status."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import Any

import kopf

from ibckpt.api import CHECKPOINT_JOB, CheckpointJobStatus, JobPhase
from ibckpt.store import s3
from ibckpt.tls import client_context, server_context_from_pem
from ibckpt_operator import metrics, webhook
from ibckpt_operator.cluster import admission, internaltls
from ibckpt_operator.cluster.agents import AgentGateway
from ibckpt_operator.cluster.agenttokens import AgentTokens
from ibckpt_operator.cluster.kube import Kube, client_configuration, new_api_client
from ibckpt_operator.cluster.leader import LeaderLease
from ibckpt_operator.config import FINALIZER, current
from ibckpt_operator.coordinator.server import CoordinatorServer
from ibckpt_operator.drivers import runtime
from ibckpt_operator.drivers.checkpointstore import job_key
from ibckpt_operator.machine import PodClaims
from ibckpt_operator.machine.status import job_state
from ibckpt_operator.machine.webhookcert import WebhookCert

log = logging.getLogger(__name__)


def tune(settings: kopf.OperatorSettings) -> None:
    # Our CRDs' status is structural: kopf's own bookkeeping goes to annotations, not status.kopf.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.ibckpt.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.ibckpt.io", key="last-handled-configuration"
    )
    settings.background.cancellation_polling = 2.0  # a deleted job's finalizer goes soon after its daemon
    settings.posting.level = logging.ERROR  # our Events are written by the drivers themselves
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60


async def rebuild_claims(kube: Kube) -> PodClaims:
    jobs = []
    for body in await kube.list_custom(CHECKPOINT_JOB.plural):
        status = body.get("status") or {}
        if not status.get("attempt") or status.get("phase") in (JobPhase.SUCCEEDED, JobPhase.FAILED):
            continue
        try:
            state = job_state(CheckpointJobStatus.from_wire(status))
        except ValueError:
            continue
        meta = body["metadata"]
        jobs.append((job_key(meta["namespace"], meta["name"]), state))
    return PodClaims.from_jobs(jobs)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf talks to the same apiserver, as the same identity, as the operator's own client."""
    configuration = client_configuration()
    keys = configuration.api_key or {}
    authorization = str(keys.get("BearerToken") or keys.get("authorization") or "")
    scheme, _sep, value = authorization.partition(" ")
    token = value.strip() if scheme.lower() == "bearer" else None
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    tune(settings)
    config = current()
    kube = Kube(new_api_client())
    # kopf starts the server after start-up: a standby serves nothing
    await webhook.serve_admission(settings, kube, config.namespace)
    lease = None
    metrics.serve(config.metrics_host, config.metrics_port)  # a standby's too: it says leader 0
    if config.lease_enabled:
        lease = LeaderLease(kube, config.namespace, config.lease_name, config.identity, config.lease_seconds)
        runtime.awaiting(lease)
        await lease.acquire()
    endpoint = webhook.endpoint()
    if endpoint is not None:
        await admission.publish(kube, endpoint)  # the apiserver calls this replica from now on
    # the agents' pods wait (Pending) for their Secret: a new release's first leader makes it here
    secrets = (config.namespace, config.tls_ca_secret, config.agent_tls_secret, config.tls_secret_owner)
    ca = await internaltls.ensure(kube, *secrets)
    coordinator = CoordinatorServer(
        server_context_from_pem(ca.tls_crt, ca.tls_key), config.coordinator_bind, config.coordinator_port
    )
    await coordinator.start()
    held = lease
    tokens = AgentTokens.of_account(kube, config.namespace, config.operator_account)
    gateway = AgentGateway(
        client_context(ca.ca_crt), tokens, epoch=lambda: held.epoch if held is not None else None
    )
    rt = runtime.Runtime(kube=kube, gateway=gateway, coordinator=coordinator, lease=lease)
    rt.claims = await rebuild_claims(kube)
    if lease is not None:
        keeper = asyncio.ensure_future(lease.keep(rt.lost.set))
        rt.tasks.add(keeper)

    def renewed(kept: WebhookCert) -> None:
        gateway.tls = client_context(kept.ca_crt)
        coordinator.tls = server_context_from_pem(kept.tls_crt, kept.tls_key)

    rt.tasks.add(asyncio.ensure_future(internaltls.keep(kube, *secrets, renewed)))
    if endpoint is not None:  # the serving certificate is renewed while this leader runs, not only at starts
        rt.tasks.add(
            asyncio.ensure_future(
                webhook.keep_renewed(kube, config.namespace, functools.partial(admission.publish, kube))
            )
        )
    runtime.set_runtime(rt)
    runtime.awaiting(None)
    # botocore's models load in the background now, not in the first job's storage check (s3.warm)
    threading.Thread(target=_warm_store, name="warm store", daemon=True).start()
    log.info("ibckpt operator started; coordinator on port %d", coordinator.port)


def _warm_store() -> None:
    try:
        s3.warm()
    except Exception as exc:  # the storage check that needs it reports its own error
        log.warning("the image store could not be prepared: %s", exc)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    try:
        rt = runtime.get()
    except RuntimeError:
        return
    for task in rt.tasks:
        task.cancel()
    await rt.coordinator.stop()
    if webhook.endpoint() is not None:
        try:
            await admission.withdraw(rt.kube)
        except Exception as error:  # the configurations fail open: a stale address costs a timeout
            log.warning("could not empty the webhook configurations: %s", error)
    if rt.lease is not None:
        await asyncio.to_thread(rt.lease.release)
    rt.kube.api.close()  # type: ignore[no-untyped-call]
    runtime.set_runtime(None)
