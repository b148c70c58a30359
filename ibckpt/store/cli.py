"""`ibckpt images ...`: list, inspect, verify, delete and garbage-collect checkpoint images; upload and
download a directory by hand. Thin: parsing and printing only, the work is in ImageStore."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ibckpt.store.config import (
    StoreConfig,
    config_from_env,
    credentials_from_secret,
    decode_encryption_key,
    read_secret_dir,
)
from ibckpt.store.errors import ConfigError, StoreError
from ibckpt.store.gc import DEFAULT_ABANDONED_AFTER, DEFAULT_GRACE, GcReport
from ibckpt.store.layout import CheckpointRef, parse_checkpoint_ref
from ibckpt.store.manifest import Manifest, RankInfo, Versions
from ibckpt.store.retention import RetentionPolicy
from ibckpt.store.store import ImageStore
from ibckpt.store.units import format_duration, format_size, parse_duration, parse_size

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

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
    commands = images.add_subparsers(dest="images_command", metavar="SUBCOMMAND", required=True)

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(
            name, parents=[common], help=help_text, description=help_text
        )
        parser.set_defaults(handler=lambda args: _run(args, handler))
        return parser

    ls = add("ls", _ls, "list committed checkpoints")
    ls.add_argument("--job", help="only this job")
    ls.add_argument("--brief", action="store_true", help="do not read manifests (no sizes)")

    show = add("show", _show, "show one checkpoint's manifest")
    show.add_argument("checkpoint", help="JOB/ID or JOB/latest")
    show.add_argument("--files", action="store_true", help="list every file")

    verify = add("verify", _verify, "fetch and check every chunk of a checkpoint")
    verify.add_argument("checkpoint", help="JOB/ID or JOB/latest")
    verify.add_argument("--quick", action="store_true", help="only check that chunks exist with their size")

    rm = add("rm", _rm, "delete checkpoints (chunks go at the next gc)")
    rm.add_argument("checkpoints", nargs="+", help="JOB/ID ...")

    gc = add("gc", _gc, "apply retention rules, then delete chunks no checkpoint uses")
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

    upload = add("upload", _upload, "upload a directory as a checkpoint")
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

    stage = add("stage", _stage, "stage a directory as one node's part of a multi-node checkpoint")
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

    commit = add("commit", _commit, "merge the staged parts of a checkpoint and commit it")
    commit.add_argument("checkpoint", help="JOB/ID")
    commit.add_argument(
        "--expect", default="", help="comma-separated parts that must be present (default: any staged)"
    )

    download = add("download", _download, "download a checkpoint into a new directory")
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
        store = ImageStore.open(config)
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


def _ref(store: ImageStore, text: str) -> CheckpointRef:
    job, checkpoint_id = parse_checkpoint_ref(text)
    return store.resolve(job, checkpoint_id)


def _emit_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


@contextmanager
def _progress(args: argparse.Namespace, label: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar with throughput on stderr, when stderr is a terminal."""
    if args.no_progress or not sys.stderr.isatty():
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda amount: bar.advance(task, amount)


def _stages(timings: dict[str, float]) -> str:
    """`read 0.03/0.38s, hash ...`: CPU / elapsed seconds per stage, summed over threads."""
    parts = [
        f"{stage} {timings.get(stage + '_cpu', 0.0):.2f}/{seconds:.2f}s"
        for stage, seconds in timings.items()
        if not stage.endswith("_cpu") and stage != "total"
    ]
    return ", ".join(parts)


def _rate(size: int, seconds: float) -> str:
    return f"{format_size(size / seconds)}/s" if seconds > 0 else "-"


# -- handlers -------------------------------------------------------------------------------------------
def _ls(args: argparse.Namespace, store: ImageStore) -> int:
    entries = store.checkpoints(args.job)
    manifests: dict[CheckpointRef, Manifest] = {}
    if not args.brief:
        from ibckpt.store.catalog import load_many

        loaded = load_many(store.context, [entry.ref for entry in entries], store.config.workers)
        manifests = {ref: found for ref, found in loaded.items() if isinstance(found, Manifest)}
    rows = []
    for entry in entries:
        manifest = manifests.get(entry.ref)
        row: dict[str, Any] = {
            "job": entry.ref.job,
            "checkpoint_id": entry.ref.checkpoint_id,
            "committed_at": entry.committed_at.isoformat(),
        }
        if manifest is not None:
            row |= {
                "ranks": len(manifest.ranks),
                "files": manifest.stats.files,
                "logical_bytes": manifest.stats.logical_bytes,
                "stored_bytes": manifest.stats.stored_bytes,
                "encryption": manifest.encryption.mode,
            }
        rows.append(row)
    if args.output == "json":
        _emit_json(rows)
        return EXIT_OK
    table = Table(box=None)
    for column in ("JOB", "CHECKPOINT", "COMMITTED", "RANKS", "FILES", "SIZE", "STORED"):
        table.add_column(
            column, justify="right" if column in {"RANKS", "FILES", "SIZE", "STORED"} else "left"
        )
    for row in rows:
        table.add_row(
            row["job"],
            row["checkpoint_id"],
            row["committed_at"][:19].replace("T", " "),
            str(row.get("ranks", "")),
            str(row.get("files", "")),
            format_size(row["logical_bytes"]) if "logical_bytes" in row else "",
            format_size(row["stored_bytes"]) if "stored_bytes" in row else "",
        )
    # Not a terminal: wide enough that nothing is cut (scripts should use -o json anyway).
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
    return EXIT_OK


def _show(args: argparse.Namespace, store: ImageStore) -> int:
    manifest = store.manifest(_ref(store, args.checkpoint))
    if args.output == "json":
        print(manifest.model_dump_json(indent=2))
        return EXIT_OK
    stats = manifest.stats
    lines = [
        f"checkpoint   {manifest.ref}",
        f"created      {manifest.created_at.isoformat()} (started {manifest.started_at.isoformat()})",
        f"size         {format_size(stats.logical_bytes)} in {stats.files} files, "
        f"{stats.chunks} chunks ({stats.distinct_chunks} distinct)",
        f"stored       {format_size(stats.stored_bytes)}; this checkpoint uploaded {stats.uploaded_chunks} "
        f"chunks, {format_size(stats.uploaded_bytes)}",
        f"compression  {manifest.compression.codec} level {manifest.compression.level}, "
        f"chunks of {format_size(manifest.compression.chunk_size)}",
        f"encryption   {manifest.encryption.mode}"
        + (f" (key {manifest.encryption.key_fingerprint})" if manifest.encryption.key_fingerprint else ""),
        "versions     " + ", ".join(f"{k} {v}" for k, v in manifest.versions.model_dump().items() if v),
        f"timings      {manifest.timings.get('total', 0.0):.2f}s in all; "
        f"per stage, CPU/elapsed thread-seconds: {_stages(manifest.timings)}",
    ]
    for rank in manifest.ranks:
        lines.append(f"rank {rank.rank:<7} pod {rank.pod or '-'} on node {rank.node or '-'} at /{rank.root}")
    for key, value in manifest.labels.items():
        lines.append(f"label        {key}={value}")
    if args.files:
        for record in manifest.files:
            lines.append(f"  {record.mode:04o} {record.kind:7} {format_size(record.size):>10}  {record.path}")
    print("\n".join(lines))
    return EXIT_OK


def _verify(args: argparse.Namespace, store: ImageStore) -> int:
    ref = _ref(store, args.checkpoint)
    total = store.manifest(ref).stats.logical_bytes
    with _progress(args, f"verify {ref}", total) as progress:
        report = store.verify(ref, deep=not args.quick, progress=progress)
    problems = [
        {"chunk": problem.chunk_id, "problem": type(problem).__name__, "message": str(problem)}
        for problem in report.problems
    ]
    if args.output == "json":
        _emit_json(
            {
                "checkpoint": str(ref),
                "ok": not problems,
                "chunks": report.chunks,
                "bytes": report.logical_bytes,
                "seconds": round(report.seconds, 3),
                "problems": problems,
            }
        )
    else:
        for problem in problems:
            print(f"BAD  {problem['message']}", file=sys.stderr)
        verdict = "OK" if not problems else f"FAILED: {len(problems)} bad chunk(s)"
        print(
            f"{verdict}  {ref}: {report.chunks} chunks, {format_size(report.logical_bytes)} checked in "
            f"{report.seconds:.1f}s ({_rate(report.logical_bytes, report.seconds)})"
        )
    return EXIT_OK if not problems else EXIT_FAILED


def _rm(args: argparse.Namespace, store: ImageStore) -> int:
    refs = [_ref(store, text) for text in args.checkpoints]
    for ref in refs:
        store.delete(ref)
    if args.output == "json":
        _emit_json({"deleted": [str(ref) for ref in refs]})
    else:
        for ref in refs:
            print(f"deleted {ref}")
    return EXIT_OK


def _gc(args: argparse.Namespace, store: ImageStore) -> int:
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        max_age=timedelta(seconds=args.max_age) if args.max_age is not None else None,
        max_bytes=args.max_size,
        min_keep=args.min_keep,
    )
    report = store.gc(
        policy,
        grace=timedelta(seconds=args.grace),
        job=args.job,
        dry_run=args.dry_run,
        sweep=not args.no_sweep,
        abandoned_after=timedelta(seconds=args.abandoned_after),
    )
    if args.output == "json":
        _emit_json(_gc_json(report))
        return EXIT_OK
    would = "would delete" if report.dry_run else "deleted"
    for decision in report.decisions:
        print(f"{'keep' if decision.keep else would:>12}  {decision.ref}  ({decision.reason})")
    if report.swept:
        print(
            f"chunks: {report.chunks_total} in the bucket, {report.chunks_referenced} in use, "
            f"{report.chunks_in_grace} unused but within the grace period; {would} {report.chunks_deleted} "
            f"({format_size(report.bytes_deleted)})"
        )
        if report.stale_leases_removed or report.multipart_aborted or report.abandoned_parts_removed:
            print(
                f"removed {report.stale_leases_removed} expired lease(s) and "
                f"{report.abandoned_parts_removed} abandoned part(s), "
                f"aborted {report.multipart_aborted} stale multipart upload(s)"
            )
    elif report.skipped_reason:
        print(f"chunk sweep deferred: {report.skipped_reason}")
        for holder in report.deferred_by:
            print(f"  {holder}")
    return EXIT_OK


def _gc_json(report: GcReport) -> dict[str, Any]:
    return {
        "dry_run": report.dry_run,
        "decisions": [
            {"checkpoint": str(decision.ref), "keep": decision.keep, "reason": decision.reason}
            for decision in report.decisions
        ],
        "deleted_checkpoints": [str(ref) for ref in report.deleted_checkpoints],
        "swept": report.swept,
        "sweep_skipped_reason": report.skipped_reason,
        "deferred_by": report.deferred_by,
        "chunks_total": report.chunks_total,
        "chunks_referenced": report.chunks_referenced,
        "chunks_in_grace": report.chunks_in_grace,
        "chunks_deleted": report.chunks_deleted,
        "bytes_deleted": report.bytes_deleted,
        "stale_leases_removed": report.stale_leases_removed,
        "abandoned_parts_removed": report.abandoned_parts_removed,
        "multipart_aborted": report.multipart_aborted,
    }


def _labels(pairs: list[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--label wants KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


def _tree_size(root: Path) -> int:
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def _upload(args: argparse.Namespace, store: ImageStore) -> int:
    if not args.directory.is_dir():
        raise ConfigError(f"{args.directory} is not a directory")
    started = time.perf_counter()
    rank = RankInfo(rank=args.rank, pod=args.pod, node=args.node)
    versions = Versions(criu=args.criu_version, kernel=args.kernel_version or os.uname().release)
    with _progress(args, "upload", _tree_size(args.directory)) as progress:
        manifest = store.upload_tree(
            args.directory,
            args.job,
            args.checkpoint_id,
            ranks=[rank],
            versions=versions,
            labels=_labels(args.label),
            progress=progress,
        )
    seconds = time.perf_counter() - started
    stats = manifest.stats
    if args.output == "json":
        _emit_json(
            {
                "checkpoint": str(manifest.ref),
                "seconds": round(seconds, 3),
                "bytes_per_second": round(stats.logical_bytes / seconds) if seconds else None,
                "stats": stats.model_dump(),
                "timings": manifest.timings,
            }
        )
    else:
        print(
            f"committed {manifest.ref}: {format_size(stats.logical_bytes)} in {seconds:.1f}s "
            f"({_rate(stats.logical_bytes, seconds)}); {stats.uploaded_chunks} of {stats.distinct_chunks} "
            f"chunks new ({format_size(stats.uploaded_bytes)} sent), {format_size(stats.stored_bytes)} stored"
        )
        print(f"per stage, CPU/elapsed thread-seconds: {_stages(manifest.timings)}")
    return EXIT_OK


def _stage(args: argparse.Namespace, store: ImageStore) -> int:
    if not args.directory.is_dir():
        raise ConfigError(f"{args.directory} is not a directory")
    started = time.perf_counter()
    rank = RankInfo(rank=args.rank, pod=args.pod, node=args.node or args.part, root=args.under)
    versions = Versions(criu=args.criu_version, kernel=os.uname().release)
    with (
        _progress(args, "stage", _tree_size(args.directory)) as progress,
        store.writer(args.job, args.checkpoint_id, progress=progress) as writer,
    ):
        writer.add_tree(args.directory, under=args.under)
        staged = writer.stage(args.part, [rank], versions)
    seconds = time.perf_counter() - started
    stats = staged.stats
    if args.output == "json":
        _emit_json({"part": args.part, "seconds": round(seconds, 3), "stats": stats.model_dump()})
    else:
        print(
            f"staged part {args.part} of {args.job}/{args.checkpoint_id}: {format_size(stats.logical_bytes)} "
            f"in {seconds:.1f}s; {stats.uploaded_chunks} of {stats.distinct_chunks} chunks new"
        )
    return EXIT_OK


def _commit(args: argparse.Namespace, store: ImageStore) -> int:
    job, checkpoint_id = parse_checkpoint_ref(args.checkpoint)
    expected = [part for part in args.expect.split(",") if part] or None
    manifest = store.commit_parts(job, checkpoint_id, expected)
    if args.output == "json":
        _emit_json(
            {
                "checkpoint": str(manifest.ref),
                "ranks": len(manifest.ranks),
                "stats": manifest.stats.model_dump(),
            }
        )
    else:
        print(
            f"committed {manifest.ref}: {len(manifest.ranks)} rank(s), "
            f"{format_size(manifest.stats.logical_bytes)}, {manifest.stats.files} files"
        )
    return EXIT_OK


def _download(args: argparse.Namespace, store: ImageStore) -> int:
    ref = _ref(store, args.checkpoint)
    total = store.manifest(ref).stats.logical_bytes
    with _progress(args, "download", total) as progress:
        report = store.restore(ref, args.directory, progress=progress)
    if args.output == "json":
        _emit_json(
            {
                "checkpoint": str(ref),
                "directory": str(args.directory),
                "bytes": report.logical_bytes,
                "chunks": report.chunks,
                "seconds": round(report.seconds, 3),
                "stages": {stage: round(value, 4) for stage, value in report.stages.items()},
            }
        )
    else:
        print(
            f"restored {ref} into {args.directory}: {format_size(report.logical_bytes)} in "
            f"{report.seconds:.1f}s ({_rate(report.logical_bytes, report.seconds)}), every chunk verified"
        )
    return EXIT_OK
