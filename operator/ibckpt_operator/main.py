"""`ibckpt-operator`: kopf with the ibckpt handlers, health endpoints, /metrics, and one active replica
at a time (a coordination.k8s.io Lease, taken before any handler runs; the others wait as standbys)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading

import kopf

from ibckpt import logsetup
from ibckpt.store.signing import KEYS_DIR_ENV
from ibckpt_operator import config as settings


def fence(seconds: float) -> threading.Timer:
    """A replica that lost the Lease is gone within `seconds`, whatever its shutdown waits for (a daemon,
    a call in an executor thread): it must make no call once another replica may lead."""

    def end() -> None:
        logging.getLogger(__name__).error("still running %.1f s after losing the Lease: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return timer


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(prog="ibckpt-operator", description=__doc__)
    parser.add_argument("--namespace", default=env.get("POD_NAMESPACE", "ibckpt-system"),
                        help="the operator's own namespace: its Lease and the agent pods")  # fmt: skip
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--metrics-port", type=int, default=9108, help="0: no /metrics")
    parser.add_argument("--liveness-port", type=int, default=8080, help="/healthz and /readyz; 0: none")
    parser.add_argument("--coordinator-port", type=int, default=7070)
    parser.add_argument("--coordinator-host", default="",
                        help="address agents dial (default: POD_IP, else the default route's)")  # fmt: skip
    parser.add_argument("--lease-name", default="ibckpt-operator")
    parser.add_argument("--lease-seconds", type=float, default=15.0)
    parser.add_argument("--no-lease", action="store_true", help="do not elect (a single test operator)")
    parser.add_argument("--agent-port", type=int, default=settings.current().agent_port)
    parser.add_argument("--operator-account", default=settings.current().operator_account,
                        help="the operator's own service account (in --namespace): it requests that "
                        "account's tokens for the agents, one per node")  # fmt: skip
    parser.add_argument("--tls-ca-secret", default=settings.current().tls_ca_secret,
                        help="Secret (in --namespace) keeping the operator's CA and the coordinator's "
                        "certificate; only the operator reads it")  # fmt: skip
    parser.add_argument("--agent-tls-secret", default=settings.current().agent_tls_secret,
                        help="Secret (in --namespace) the operator writes the agents' serving "
                        "certificate and the CA into; their DaemonSet mounts it")  # fmt: skip
    parser.add_argument("--tls-secret-owner", default="",
                        help="the operator's Deployment: owns both Secrets (removed with it)")  # fmt: skip
    parser.add_argument("--agent-account", default="",
                        help="the agents' service account (in --namespace): given get on each storage's "
                        "Secrets, by name, in the storage's namespace; empty: none")  # fmt: skip
    parser.add_argument("--release", default="",
                        help="the Helm release's name: labels the storage Roles the operator makes, so "
                        "`kubectl ibckpt uninstall` finds them")  # fmt: skip
    parser.add_argument("--image-keys", default=env.get(KEYS_DIR_ENV, ""),
                        help="the image key set's directory (the chart mounts its Secret): the commit "
                        "verifies the agents' parts with it and signs the manifest; empty: unsigned "
                        "checkpoints, which the agents refuse to restore ($IBCKPT_IMAGE_KEYS)")  # fmt: skip
    parser.add_argument("--grants-owner", default="",
                        help="the agents' ClusterRole: it owns the storage Roles, so deleting it (helm "
                        "uninstall) has Kubernetes delete them in every namespace")  # fmt: skip
    parser.add_argument("--memory-tier", action="store_true",
                        help="the agents keep a memory tier (the chart's agent.memoryTier): ask each "
                        "checkpointing node to keep its part in the next node's agent too")  # fmt: skip
    parser.add_argument("--gc-grace-seconds", type=float, default=3600.0,
                        help="a deleted Checkpoint's chunks younger than this are swept later")  # fmt: skip
    parser.add_argument("--store-sweep-seconds", type=float, default=3600.0,
                        help="how often each CheckpointStorage's bucket is swept of what no checkpoint "
                        "uses")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logsetup.configure(args.log_level)
    settings.configure(
        settings.current().with_(
            namespace=args.namespace,
            metrics_port=args.metrics_port,
            coordinator_port=args.coordinator_port,
            coordinator_host=args.coordinator_host,
            lease_name=args.lease_name,
            lease_seconds=args.lease_seconds,
            lease_enabled=not args.no_lease,
            agent_port=args.agent_port,
            operator_account=args.operator_account,
            tls_ca_secret=args.tls_ca_secret,
            agent_tls_secret=args.agent_tls_secret,
            tls_secret_owner=args.tls_secret_owner,
            agent_account=args.agent_account,
            release=args.release,
            image_keys=args.image_keys,
            grants_owner=args.grants_owner,
            memory_tier=args.memory_tier,
            gc_grace_seconds=args.gc_grace_seconds,
            store_sweep_seconds=args.store_sweep_seconds,
        )
    )
    import ibckpt_operator.handlers  # noqa: F401 - registers the handlers with kopf
    from ibckpt_operator import health
    from ibckpt_operator.cluster.leader import STEP_DOWN
    from ibckpt_operator.drivers import runtime

    async def run() -> None:
        stop = asyncio.Event()  # not a threading.Event: kopf would park an executor thread on it

        async def lease_watch() -> None:
            # A replica that lost the Lease stops: the next leader resumes the jobs from their status.
            while True:
                await asyncio.sleep(1.0)
                try:
                    if runtime.get().lost.is_set():
                        # Another replica may lead once the Lease runs out, a third of its duration
                        # after this one stepped down: be gone in half of that.
                        fence(args.lease_seconds * (1 - STEP_DOWN) / 2)
                        stop.set()
                        return
                except RuntimeError:
                    continue

        watcher = asyncio.ensure_future(lease_watch())
        probes = await health.serve("0.0.0.0", args.liveness_port) if args.liveness_port else None
        try:
            await kopf.operator(clusterwide=True, standalone=True, stop_flag=stop)
        finally:
            watcher.cancel()
            if probes is not None:
                await probes.cleanup()

    asyncio.run(run())


if __name__ == "__main__":
    main()
