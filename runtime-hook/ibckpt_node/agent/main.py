"""`ibckpt-agent`: the node agent daemon (the chart's DaemonSet runs it on every RDMA node).

    ibckpt-agent --node NAME --address NODE_IP [--port 9478] [--metrics-port 9479]
        [--host-dir /var/lib/ibckpt] [--install [--install-root /host] [--prefix /usr/local]]
        [--keep-failed-images SECONDS] [--tls-dir /etc/ibckpt/agent-tls]
        --allow system:serviceaccount:NS:NAME ...

At start, with --install, it copies the node pieces onto the host (ibckpt_node.hook.install: the hook,
the runtime wrapper and the shim under PREFIX, /etc/ibckpt/node.json), so that containerd finds them in
the node's own filesystem (seen here under --install-root). Then it hosts the container registry on
HOST_DIR/registry.sock and serves the agent API (ibckpt.agentapi) over TLS only on NODE_IP:PORT, with
the certificate in --tls-dir (tls.crt, tls.key: the operator's Secret), to the identities given with
--allow, and Prometheus metrics on NODE_IP:METRICS_PORT. It never binds a wildcard address.
It keeps what sessions leave under HOST_DIR bounded (agent/disk.py; --keep-failed-images).
With --node-setup it checks the node's prerequisites, installs containerd's runtime handler and labels
its Node (nodesetup/lifecycle.py); /readyz answers 200 only once that is done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from ibckpt import logsetup
from ibckpt.agentapi.memory import MEMORY_TIER_AUDIENCE
from ibckpt.agentapi.models import DEFAULT_PORT, agent_audience
from ibckpt.tls import TlsSetupError, client_context_from
from ibckpt_node import container_runtime, failpoints
from ibckpt_node.agent.auth import Authenticator, TokenReviewer
from ibckpt_node.agent.disk import DEFAULT_KEEP_FAILED_S
from ibckpt_node.agent.kubesecrets import KubeSecrets
from ibckpt_node.agent.server import AgentServer
from ibckpt_node.agent.servingcert import DEFAULT_DIR as DEFAULT_TLS_DIR
from ibckpt_node.agent.servingcert import DEFAULT_WAIT_S as DEFAULT_TLS_WAIT_S
from ibckpt_node.agent.servingcert import ServingCertificate
from ibckpt_node.criu import CriuError
from ibckpt_node.hook import install
from ibckpt_node.nodesetup import host as nodehost
from ibckpt_node.nodesetup.kube import NodeApi
from ibckpt_node.nodesetup.lifecycle import RECHECK_S, NodeLifecycle
from ibckpt_node.registry import ContainerRegistry

log = logging.getLogger("ibckpt_node.agent")

DEFAULT_HOST_DIR = "/var/lib/ibckpt"
IMAGE_SHIM = "/usr/lib/ibckpt/libibckpt.so"  # where the Dockerfile puts it
IMAGE_CRIU_PLUGINS = "/usr/lib/ibckpt/criu"  # ibckpt_uverbs.so, for pre-dumps (Dockerfile)
IMAGE_FRONT = Path("/usr/lib/ibckpt/ibckpt-front")  # ibckpt-hook's and ibckpt-runc's first step (Dockerfile)


def current_shim(prefix: str, shim_source: Path) -> str:
    """The node path of the shim new containers mount: this image's build (hook/install.py keeps it
    there), or the file of a release before builds were kept when the image has none."""
    if shim_source.is_file():
        return install.build_host_path(prefix, install.file_digest(shim_source))
    return f"{prefix}/lib/ibckpt/libibckpt.so"


def criu_plugins_on_node(prefix: str, lib_dir: Path) -> str:
    """CRIU's plugin dir for pre-dumps as runc's CRIU sees it on the node, when the install put one
    there (hook/install.py); empty: a CheckpointJob's preDump then dumps in full (docs/node-agent.md)."""
    return f"{prefix}/lib/ibckpt/criu" if (lib_dir / "criu" / "ibckpt_uverbs.so").is_file() else ""


def node_config(prefix: str, host_dir: str, runc: str, shim: str) -> dict[str, object]:
    """/etc/ibckpt/node.json: where the hook and the wrapper find everything (host paths)."""
    return {
        "runc": runc,
        "shim": shim,
        "hook": f"{prefix}/bin/ibckpt-hook",
        "state_dir": host_dir,
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ibckpt-agent", description=__doc__.splitlines()[0])
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name ($NODE_NAME)")
    parser.add_argument(
        "--address", default=os.environ.get("HOST_IP"), help="the node address to serve on ($HOST_IP)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_PORT + 1, help="0: no metrics server")
    parser.add_argument("--host-dir", default=DEFAULT_HOST_DIR, help="the node's ibckpt dir (same path here)")
    parser.add_argument("--install", action="store_true", help="install the hook, wrapper and shim first")
    parser.add_argument(
        "--install-root",
        default="/",
        help="the node's / as this process sees it (the chart mounts /host/...)",
    )
    parser.add_argument(
        "--prefix",
        default="/usr/local",
        help="the node's install prefix: PREFIX/bin/ibckpt-runc, PREFIX/lib/ibckpt",
    )
    parser.add_argument("--shim-source", default=IMAGE_SHIM)
    parser.add_argument("--node-python", default="/usr/bin/python3", help="the node's python3 (>= 3.9)")
    parser.add_argument(
        "--next-runtime",
        "--runc",
        dest="runc",
        default="/usr/sbin/runc",
        help="the runtime the wrapper passes everything to: the node's runc, or nvidia-container-runtime",
    )
    parser.add_argument(
        "--node-setup",
        action="store_true",
        help="check the node's prerequisites, then configure the runtime handler and label the Node",
    )
    parser.add_argument("--manage-runtime", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--containerd-config", default="/etc/containerd/config.toml", help="a node path")
    parser.add_argument(
        "--containerd-dropin", default="/etc/containerd/conf.d/ibckpt.toml", help="a node path"
    )
    parser.add_argument("--runtime-restart", choices=nodehost.RESTART_MODES, default="auto")
    parser.add_argument("--runtime-handler", default="ibckpt", help="the RuntimeClass's handler name")
    parser.add_argument(
        "--daemonset",
        default=os.environ.get("IBCKPT_AGENT_DAEMONSET", ""),
        help="this agent's DaemonSet (in $POD_NAMESPACE): gone at SIGTERM means an uninstall",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[i for i in os.environ.get("IBCKPT_AGENT_ALLOW", "").split(",") if i],
        help="an identity that may call the API (system:serviceaccount:NS:NAME); $IBCKPT_AGENT_ALLOW",
    )
    parser.add_argument(
        "--memory-tier-bytes",
        type=int,
        default=int(os.environ.get("IBCKPT_MEMORY_TIER_BYTES") or 0),
        help="what this agent may hold of the other nodes' checkpoint parts (the memory tier); 0: off "
        "($IBCKPT_MEMORY_TIER_BYTES)",
    )
    parser.add_argument(
        "--agent-identity",
        default=os.environ.get("IBCKPT_AGENT_IDENTITY", ""),
        help="the agents' own identity (system:serviceaccount:NS:NAME), which the memory tier's routes "
        "accept with tokens of its audience ($IBCKPT_AGENT_IDENTITY)",
    )
    parser.add_argument(
        "--memory-tier-token",
        default=os.environ.get("IBCKPT_MEMORY_TIER_TOKEN_FILE", ""),
        metavar="FILE",
        help="this agent's token for the other agents' memory tier, read at each use "
        "($IBCKPT_MEMORY_TIER_TOKEN_FILE); empty: it keeps no copies elsewhere",
    )
    parser.add_argument(
        "--image-keys",
        default=os.environ.get("IBCKPT_IMAGE_KEYS"),
        metavar="DIR",
        help="the image key set (the chart mounts its Secret): parts are signed with it and only manifests "
        "it verifies are restored; without it the agent stages and restores nothing ($IBCKPT_IMAGE_KEYS)",
    )
    parser.add_argument(
        "--keep-failed-images",
        type=float,
        default=DEFAULT_KEEP_FAILED_S,
        metavar="SECONDS",
        help="how long the images of a checkpoint that was not staged (its upload failed, say) stay on "
        "the node; 0: removed at once (default: %(default)g)",
    )
    parser.add_argument(
        "--disk-reserve-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="what a checkpoint's images must leave free on the node's disk (for the kubelet's eviction "
        "threshold, say); a checkpoint that would not is refused before any rank is touched",
    )
    parser.add_argument(
        "--disk-window-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="what a Stop or Hold checkpoint's images may hold on the node's disk while they upload: "
        "page data leaves the disk once stored, and CRIU waits for the upload past this (0: the whole "
        "images stay until the upload ends)",
    )
    parser.add_argument(
        "--no-pre-upload",
        dest="pre_upload",
        action="store_false",
        help="upload a checkpoint's images only once the dump has ended, not its pages while CRIU "
        "writes them (to compare the two)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long to wait for the aborted sessions' ranks to run again; keep it under "
        "the pod's termination grace period (default: %(default)g)",
    )
    parser.add_argument(
        "--tls-dir",
        type=Path,
        default=DEFAULT_TLS_DIR,
        help="the serving certificate (tls.crt, tls.key) and the operator's CA (ca.crt), as the chart "
        "mounts the operator's Secret (default: %(default)s)",
    )
    parser.add_argument(
        "--tls-wait",
        type=float,
        default=DEFAULT_TLS_WAIT_S,
        metavar="SECONDS",
        help="how long to wait for the certificate's files (the operator issues them once it leads) "
        "before giving up (default: %(default)g)",
    )
    parser.add_argument("--log-level", default=os.environ.get("IBCKPT_LOG_LEVEL", "info"))
    parser.add_argument(
        "--failpoints",
        action="store_true",
        help="tests only: wait where a file under HOST_DIR/failpoints says (ibckpt_node.failpoints)",
    )
    args = parser.parse_args(argv)
    if not args.node or not args.address:
        parser.error("--node and --address are required (or NODE_NAME and HOST_IP)")
    if args.address in ("0.0.0.0", "::"):
        parser.error("--address must be one of the node's addresses, not a wildcard")
    if args.disk_reserve_bytes < 0:
        parser.error("--disk-reserve-bytes must be 0 or more")
    if args.disk_window_bytes < 0:
        parser.error("--disk-window-bytes must be 0 or more")
    if args.tls_wait < 0:
        parser.error("--tls-wait must be 0 or more seconds")
    if args.keep_failed_images < 0:
        parser.error("--keep-failed-images must be 0 or more seconds")
    if not args.allow:
        parser.error("give at least one --allow identity (the operator's service account)")
    return args


def warm_store_imports() -> None:
    """Import the store (boto3) and load botocore's models once the agent serves: on a slow node these took
    tens of seconds, which the first checkpoint's upload or restore's download would otherwise pay."""
    try:
        from ibckpt.store import s3

        s3.warm()
    except Exception as exc:  # the session that needs the store reports its own error
        log.warning("the image store could not be prepared: %s", exc)


def warm_criu() -> None:
    """Have the node's CRIU cache its kernel facts now, not in the first checkpoint's gate."""
    try:
        said = container_runtime.warm_criu()
    except CriuError as exc:  # a checkpoint that needs CRIU reports its own error
        log.warning("CRIU could not cache its kernel facts: %s", exc)
        return
    log.info("CRIU cached its kernel facts (%s)", said.splitlines()[-1] if said else "no output")


def node_lifecycle(args: argparse.Namespace) -> NodeLifecycle:
    setup = nodehost.NodeSetup(
        root=Path(args.install_root),
        prefix=args.prefix,
        next_runtime=args.runc,
        node_python=args.node_python,
        config=args.containerd_config,
        dropin=args.containerd_dropin,
        restart=args.runtime_restart,
        manage=args.manage_runtime,
        handler_name=args.runtime_handler,
    )
    namespace = os.environ.get("POD_NAMESPACE", "")
    return NodeLifecycle(args.node, setup, NodeApi.in_cluster(), namespace, args.daemonset)


async def keep_preparing(node: NodeLifecycle) -> None:
    """Until the node is ready: a prerequisite installed later makes the agent Ready without a restart."""
    while not await asyncio.to_thread(node.prepare):
        await asyncio.sleep(RECHECK_S)


async def certified(certificate: ServingCertificate, timeout_s: float, stop: asyncio.Event) -> bool:
    """True once the certificate can be served, False if the agent is stopped first; TlsSetupError if
    none came within timeout_s."""
    waiting = asyncio.create_task(certificate.wait(timeout_s), name="certificate")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    done, _ = await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if waiting not in done:
        waiting.cancel()
        return False
    waiting.result()
    return True


async def serve(args: argparse.Namespace) -> None:
    host_dir = Path(args.host_dir)
    node = node_lifecycle(args) if args.node_setup else None
    if args.failpoints:
        failpoints.enable(host_dir / "failpoints")
    shim = current_shim(args.prefix, Path(args.shim_source))
    lib_dir = Path(args.install_root) / f"{args.prefix}/lib/ibckpt".lstrip("/")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The node's setup and the store's imports need no certificate: they overlap the operator's start.
    warm = asyncio.create_task(asyncio.to_thread(warm_store_imports), name="warm imports")
    warm_kernel = asyncio.create_task(asyncio.to_thread(warm_criu), name="warm criu")
    preparing = asyncio.create_task(keep_preparing(node), name="node setup") if node else None
    certificate = ServingCertificate(args.tls_dir)
    server: AgentServer | None = None
    try:
        if not await certified(certificate, args.tls_wait, stop):
            return
        client_context_from(certificate.ca_file)  # TlsSetupError: no CA to trust the coordinator by
        metrics = CollectorRegistry()
        server = AgentServer(
            node=args.node,
            host=args.address,
            port=args.port,
            registry=ContainerRegistry(host_dir),
            authenticator=Authenticator(
                TokenReviewer.in_cluster(agent_audience(args.node)), frozenset(args.allow)
            ),
            tls=certificate.context,
            coordinator_tls=lambda: client_context_from(certificate.ca_file),  # a renewed CA: next connect
            work_dir=host_dir,
            shim_path=shim,
            shim_present_path=Path(args.install_root) / shim.lstrip("/"),
            shim_builds=lambda: install.installed_builds(lib_dir),
            metrics=metrics,
            secrets=KubeSecrets.in_cluster(),
            keep_failed_images_s=args.keep_failed_images,
            disk_reserve_bytes=args.disk_reserve_bytes,
            disk_window_bytes=args.disk_window_bytes,
            pre_upload=args.pre_upload,
            criu_plugins=criu_plugins_on_node(args.prefix, lib_dir),
            readiness=(lambda: (node.ready, node.reason)) if node else None,
            image_keys=Path(args.image_keys) if args.image_keys else None,
            memory_budget=args.memory_tier_bytes,
            memory_authenticator=Authenticator(
                TokenReviewer.in_cluster(MEMORY_TIER_AUDIENCE), frozenset([args.agent_identity])
            )
            if args.agent_identity
            else None,
            memory_token_file=Path(args.memory_tier_token) if args.memory_tier_token else None,
        )
        if args.metrics_port:
            start_http_server(args.metrics_port, addr=args.address, registry=metrics)
        await server.start()
        await stop.wait()
    finally:
        log.info("stopping")
        if preparing:
            preparing.cancel()
        if server is not None:
            await server.close(args.stop_timeout)
        await warm
        await warm_kernel
        if node is not None and await asyncio.to_thread(node.uninstalling):
            log.info("the agent DaemonSet is gone: an uninstall; undoing what the agent did on the node")
            await asyncio.to_thread(node.uninstall)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logsetup.configure(args.log_level, "%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.install:
        config = node_config(
            args.prefix, args.host_dir, args.runc, current_shim(args.prefix, Path(args.shim_source))
        )
        install.install(
            Path(args.install_root), args.prefix, args.node_python, Path(args.shim_source), config,
            Path(IMAGE_CRIU_PLUGINS), front=IMAGE_FRONT if IMAGE_FRONT.is_file() else None,
        )  # fmt: skip
        log.info("installed the hook, the runtime wrapper and the shim under %s on the node", args.prefix)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(args))
        except TlsSetupError as exc:
            log.error("cannot serve the agent API: %s", exc)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
