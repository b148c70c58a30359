"""`python -m ibckpt_node.nodesetup check|install|remove|uninstall-release`: by hand on a node (with
--root), or the chart's pre-delete hook (uninstall-release)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ibckpt_node.nodesetup import containerd, host, prereqs, release
from ibckpt_node.nodesetup.kube import NodeApi


def setup_from(args: argparse.Namespace) -> host.NodeSetup:
    return host.NodeSetup(
        root=Path(args.root),
        prefix=args.prefix,
        next_runtime=args.next_runtime,
        node_python=args.node_python,
        config=args.containerd_config,
        dropin=args.containerd_dropin,
        restart=args.restart,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ibckpt_node.nodesetup", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=("check", "install", "remove", "uninstall-release"))
    parser.add_argument("--root", default="/", help="the node's / as this process sees it")
    parser.add_argument("--prefix", default="/usr/local")
    parser.add_argument("--next-runtime", default="/usr/sbin/runc")
    parser.add_argument("--node-python", default="/usr/bin/python3")
    parser.add_argument("--containerd-config", default="/etc/containerd/config.toml")
    parser.add_argument("--containerd-dropin", default="/etc/containerd/conf.d/ibckpt.toml")
    parser.add_argument("--restart", choices=host.RESTART_MODES, default="auto")
    parser.add_argument("--namespace", help="uninstall-release: the release's namespace")
    parser.add_argument("--daemonset", help="uninstall-release: the agent DaemonSet")
    parser.add_argument("--selector", help="uninstall-release: the agent pods' label selector")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "uninstall-release":
        if not (args.namespace and args.daemonset and args.selector):
            parser.error("uninstall-release needs --namespace, --daemonset and --selector")
        return release.uninstall_release(
            NodeApi.in_cluster(), args.namespace, args.daemonset, args.selector, args.timeout
        )
    setup = setup_from(args)
    if args.command == "check":
        findings = host.check(setup)
        for finding in findings:
            print(("ok       " if finding.ok else "MISSING  ") + finding.line())
        return 1 if prereqs.missing(findings) else 0
    try:
        edit = host.install_handler(setup) if args.command == "install" else host.remove_handler(setup)
    except containerd.ConfigRefused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print(edit.note)
    if edit.changed or (args.command == "install" and not host.containerd_loaded(setup)):
        why = host.restart_containerd(setup)
        print(why or "containerd restarted")
        return 1 if why else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
