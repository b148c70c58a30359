"""`ibckpt`: the command line. A small dispatcher; each command group registers its own subcommands
(`images`: images.py). Outside the libraries, so that only the command line needs `rich`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ibckpt import __version__


def build_parser() -> argparse.ArgumentParser:
    from ibckpt.cli import images as images_cli

    parser = argparse.ArgumentParser(
        prog="ibckpt", description="Transparent checkpoint/restart of RDMA jobs on Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"ibckpt {__version__}")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    images_cli.register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    code: int = handler(args)
    return code
