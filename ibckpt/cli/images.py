"""`ibckpt images ...`: the subcommands' flags, the store configuration they build, and the one place
errors become exit codes. What each subcommand does and prints is in images_commands.py; the work is in
ImageStore."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ibckpt.cli import images_commands as commands
from ibckpt.cli.images_commands import EXIT_FAILED, EXIT_USAGE
from ibckpt.store.config import (
    StoreConfig,
    config_from_env,
    credentials_from_secret,
    decode_encryption_key,
    read_secret_dir,
)
from ibckpt.store.errors import ConfigError, StoreError
from ibckpt.store.gc import DEFAULT_ABANDONED_AFTER, DEFAULT_GRACE
from ibckpt.store.signing import KEYS_DIR_ENV, load_keys
from ibckpt.store.store import ImageStore
from ibckpt.store.units import format_duration, parse_duration, parse_size

Handler = Callable[[argparse.Namespace, ImageStore], int]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _connection_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    s3 = flags.add_argument_group("S3 (flags override the environment variables in brackets)")
    s3.add_argument("--endpoint", help="endpoint URL; omit for AWS [IBCKPT_S3_ENDPOINT]")
    s3.add_argument("--bucket", help="[IBCKPT_S3_BUCKET]")
    s3.add_argument("--prefix", help="key prefix inside the bucket, default ibckpt [IBCKPT_S3_PREFIX]")
    s3.add_argument("--region", help="[IBCKPT_S3_REGION, AWS_REGION]")
    s3.add_argument("--addressing", choices=["auto", "path", "virtual"], help="[IBCKPT_S3_ADDRESSING]")
    s3.add_argument("--ca-bundle", help="PEM file of CAs for the endpoint's TLS [IBCKPT_S3_CA_BUNDLE]")
    s3.add_argument("--no-verify-tls", action="store_true", help="do not verify the endpoint's certificate")
    s3.add_argument(
        "--credentials-dir",
        type=Path,
        help="a mounted Secret (one file per key: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); "
        "default: the standard AWS chain [IBCKPT_S3_CREDENTIALS_DIR]",
    )
    s3.add_argument(
        "--max-attempts", type=int, help="attempts per S3 call, with backoff [IBCKPT_S3_MAX_ATTEMPTS]"
    )
    s3.add_argument("--connect-timeout", type=_duration, help="[IBCKPT_S3_CONNECT_TIMEOUT]")
    s3.add_argument("--read-timeout", type=_duration, help="[IBCKPT_S3_READ_TIMEOUT]")
    s3.add_argument("--workers", type=int, help="parallel chunk transfers [IBCKPT_WORKERS]")
    s3.add_argument(
        "--encryption", choices=["none", "sse-s3", "sse-kms", "client"], help="[IBCKPT_ENCRYPTION]"
    )
    s3.add_argument("--kms-key-id", help="for --encryption sse-kms [IBCKPT_S3_SSE_KMS_KEY_ID]")
    s3.add_argument(
        "--encryption-key-file",
        type=Path,
        help="base64 of 32 bytes, for --encryption client [IBCKPT_ENCRYPTION_KEY_FILE]",
    )
    s3.add_argument(
        "--image-keys",
        type=Path,
        default=os.environ.get(KEYS_DIR_ENV) or None,
        help="the image key set (a copy of the chart's image-keys Secret, one file per key): sign what is "
        "written, and refuse what does not verify; without it nothing is checked [IBCKPT_IMAGE_KEYS]",
    )
    out = flags.add_argument_group("output")
    out.add_argument("-o", "--output", choices=["text", "json"], default="text")
    out.add_argument("--no-progress", action="store_true", help="no progress bar (default when not a tty)")
    return flags


def register(groups: Any) -> None:
    """Add `images` and its subcommands to the top-level parser's subparsers."""
    common = _connection_flags()
    images = groups.add_parser(
        "images",
        help="checkpoint images in S3",
        description="List, inspect, verify, delete and garbage-collect checkpoint images in S3; "
        "upload and download a directory by hand. Configuration: flags, or IBCKPT_S3_* and AWS_* variables.",
    )
    subcommands = images.add_subparsers(dest="images_command", metavar="SUBCOMMAND", required=True)

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = subcommands.add_parser(
            name, parents=[common], help=help_text, description=help_text
        )
        parser.set_defaults(handler=lambda args: _run(args, handler))
        return parser

    ls = add("ls", commands.ls, "list committed checkpoints")
    ls.add_argument("--job", help="only this job")
    ls.add_argument("--brief", action="store_true", help="do not read manifests (no sizes)")

    show = add("show", commands.show, "show one checkpoint's manifest")
    show.add_argument("checkpoint", help="JOB/ID or JOB/latest")
    show.add_argument("--files", action="store_true", help="list every file")

    verify = add("verify", commands.verify, "fetch and check every chunk of a checkpoint")
    verify.add_argument("checkpoint", help="JOB/ID or JOB/latest")
    verify.add_argument("--quick", action="store_true", help="only check that chunks exist with their size")

    sign = add(
        "sign",
        commands.sign,
        "sign checkpoints with --image-keys, as they are: for ones written before manifests were signed "
        "(check what you sign: the agents restore it as root)",
    )
    sign.add_argument("checkpoints", nargs="+", help="JOB/ID ...")

    rm = add("rm", commands.rm, "delete checkpoints (chunks go at the next gc)")
    rm.add_argument("checkpoints", nargs="+", help="JOB/ID ...")

    gc = add("gc", commands.gc, "apply retention rules, then delete chunks no checkpoint uses")
    gc.add_argument("--keep-last", type=int, help="keep each job's N newest checkpoints")
    gc.add_argument("--max-age", type=_duration, help="delete checkpoints older than this (e.g. 7d)")
    gc.add_argument("--max-size", type=_size, help="per job, stored bytes the kept checkpoints may use")
    gc.add_argument("--min-keep", type=int, default=1, help="always keep each job's N newest (default 1)")
    gc.add_argument("--job", help="apply the retention rules to this job only")
    gc.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE.total_seconds(),
        help=f"keep unused chunks younger than this (default {format_duration(DEFAULT_GRACE.seconds)})",
    )
    gc.add_argument(
        "--abandoned-after",
        type=_duration,
        default=DEFAULT_ABANDONED_AFTER.total_seconds(),
        help="drop staged parts never committed for this long (default 1d)",
    )
    gc.add_argument("--dry-run", action="store_true", help="report what would be deleted")
    gc.add_argument("--no-sweep", action="store_true", help="only apply retention, keep chunks")

    upload = add("upload", commands.upload, "upload a directory as a checkpoint")
    upload.add_argument("directory", type=Path)
    upload.add_argument("--job", required=True, help="job name, or namespace/name")
    upload.add_argument("--id", dest="checkpoint_id", help="checkpoint id (default: time-based)")
    upload.add_argument("--rank", type=int, default=0)
    upload.add_argument("--pod")
    upload.add_argument("--node")
    upload.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    upload.add_argument("--criu-version")
    upload.add_argument("--kernel-version")
    upload.add_argument("--chunk-size", type=_size, help="default 8MiB [IBCKPT_CHUNK_SIZE]")
    upload.add_argument(
        "--compression-level", type=int, help="zstd level, 0 = off [IBCKPT_COMPRESSION_LEVEL]"
    )
    upload.add_argument("--max-rate", type=_size, help="bytes/s cap, e.g. 200MiB [IBCKPT_MAX_RATE]")
    upload.add_argument("--lease", type=_duration, help="writer lease, default 10m [IBCKPT_LEASE]")

    stage = add("stage", commands.stage, "stage a directory as one node's part of a multi-node checkpoint")
    stage.add_argument("directory", type=Path)
    stage.add_argument("--job", required=True, help="job name, or namespace/name")
    stage.add_argument("--id", dest="checkpoint_id", required=True, help="checkpoint id shared by all parts")
    stage.add_argument("--part", required=True, help="this part's name, usually the node")
    stage.add_argument("--under", default="", help="path of the directory inside the checkpoint")
    stage.add_argument("--rank", type=int, default=0)
    stage.add_argument("--pod")
    stage.add_argument("--node")
    stage.add_argument("--criu-version")
    stage.add_argument("--chunk-size", type=_size, help="default 8MiB [IBCKPT_CHUNK_SIZE]")
    stage.add_argument("--compression-level", type=int, help="zstd level, 0 = off")

    commit = add("commit", commands.commit, "merge the staged parts of a checkpoint and commit it")
    commit.add_argument("checkpoint", help="JOB/ID")
    commit.add_argument(
        "--expect", default="", help="comma-separated parts that must be present (default: any staged)"
    )

    download = add("download", commands.download, "download a checkpoint into a new directory")
    download.add_argument("checkpoint", help="JOB/ID or JOB/latest")
    download.add_argument("directory", type=Path)


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> StoreConfig:
    overrides: dict[str, object] = {
        "endpoint_url": args.endpoint,
        "bucket": args.bucket,
        "prefix": args.prefix,
        "region": args.region,
        "addressing_style": args.addressing,
        "ca_bundle": args.ca_bundle,
        "verify_tls": False if args.no_verify_tls else None,
        "max_attempts": args.max_attempts,
        "connect_timeout": args.connect_timeout,
        "read_timeout": args.read_timeout,
        "workers": args.workers,
        "chunk_size": getattr(args, "chunk_size", None),
        "compression_level": getattr(args, "compression_level", None),
        "max_rate": getattr(args, "max_rate", None),
        "lease_seconds": getattr(args, "lease", None),
    }
    if args.credentials_dir is not None:
        data = read_secret_dir(args.credentials_dir)
        overrides["credentials"] = credentials_from_secret(
            data, encoded=False, name=str(args.credentials_dir)
        )
    key = decode_encryption_key(args.encryption_key_file.read_text()) if args.encryption_key_file else None
    return config_from_env(
        env,
        encryption_mode=args.encryption,
        kms_key_id=args.kms_key_id,
        client_key=key,
        **{name: value for name, value in overrides.items() if value is not None},
    )


def _run(args: argparse.Namespace, handler: Handler) -> int:
    def err(message: str) -> None:
        print(f"ibckpt: {message}", file=sys.stderr)

    try:
        config = config_from_args(args)
        signing = load_keys(args.image_keys) if args.image_keys else None
        store = ImageStore.open(config, signing=signing)
        return handler(args, store)
    except ConfigError as error:
        err(f"configuration error: {error}")
        return EXIT_USAGE
    except (StoreError, ValueError, OSError) as error:
        err(f"error: {error}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        err("interrupted")
        return 130
