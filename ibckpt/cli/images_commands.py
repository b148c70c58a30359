"""`ibckpt images ...`: what each subcommand does with the ImageStore it is given, and how it prints the
result: a table or lines for people (with a rich progress bar on a terminal), or JSON with `-o json`."""

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

from ibckpt.store.catalog import load_many
from ibckpt.store.errors import ConfigError
from ibckpt.store.gc import GcReport
from ibckpt.store.layout import CheckpointRef, parse_checkpoint_ref
from ibckpt.store.manifest import Manifest, RankInfo, Versions
from ibckpt.store.retention import RetentionPolicy
from ibckpt.store.store import ImageStore
from ibckpt.store.units import format_size

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _ref(store: ImageStore, text: str) -> CheckpointRef:
    job, checkpoint_id = parse_checkpoint_ref(text)
    return store.resolve(job, checkpoint_id)


def _emit_json(value: object) -> None:
    print(json.dumps(value, indent=2, default=str))


def _answer(args: argparse.Namespace, as_json: object, text: str) -> int:
    """Print a subcommand's result: `as_json` with `-o json`, else the text for people."""
    if args.output == "json":
        _emit_json(as_json)
    else:
        print(text)
    return EXIT_OK


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


# -- subcommands ----------------------------------------------------------------------------------------
def ls(args: argparse.Namespace, store: ImageStore) -> int:
    entries = store.checkpoints(args.job)
    manifests: dict[CheckpointRef, Manifest] = {}
    if not args.brief:
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


def show(args: argparse.Namespace, store: ImageStore) -> int:
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
        f"signature    {signature_state(manifest, store)}",
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


def signature_state(manifest: Manifest, store: ImageStore) -> str:
    """What a reader should know of the manifest's signature (a store with keys has already refused any
    manifest that does not verify)."""
    signature = manifest.signature
    if store.context.signing is not None and signature is not None:
        return f"verified (key {signature.key_id})"
    if signature is None:
        return "none: the agents refuse to restore this checkpoint"
    return f"key {signature.key_id}, not verified (give --image-keys to check it)"


def verify(args: argparse.Namespace, store: ImageStore) -> int:
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


def sign(args: argparse.Namespace, store: ImageStore) -> int:
    signed = []
    for text in args.checkpoints:
        manifest = store.sign(_ref(store, text))
        assert manifest.signature is not None
        signed.append({"checkpoint": str(manifest.ref), "key_id": manifest.signature.key_id})
    lines = "\n".join(f"signed {row['checkpoint']} with key {row['key_id']}" for row in signed)
    return _answer(args, signed, lines)


def rm(args: argparse.Namespace, store: ImageStore) -> int:
    refs = [_ref(store, text) for text in args.checkpoints]
    for ref in refs:
        store.delete(ref)
    return _answer(args, {"deleted": [str(ref) for ref in refs]}, "\n".join(f"deleted {ref}" for ref in refs))


def gc(args: argparse.Namespace, store: ImageStore) -> int:
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


def upload(args: argparse.Namespace, store: ImageStore) -> int:
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
    as_json = {
        "checkpoint": str(manifest.ref),
        "seconds": round(seconds, 3),
        "bytes_per_second": round(stats.logical_bytes / seconds) if seconds else None,
        "stats": stats.model_dump(),
        "timings": manifest.timings,
    }
    text = (
        f"committed {manifest.ref}: {format_size(stats.logical_bytes)} in {seconds:.1f}s "
        f"({_rate(stats.logical_bytes, seconds)}); {stats.uploaded_chunks} of {stats.distinct_chunks} "
        f"chunks new ({format_size(stats.uploaded_bytes)} sent), {format_size(stats.stored_bytes)} stored\n"
        f"per stage, CPU/elapsed thread-seconds: {_stages(manifest.timings)}"
    )
    return _answer(args, as_json, text)


def stage(args: argparse.Namespace, store: ImageStore) -> int:
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
    as_json = {"part": args.part, "seconds": round(seconds, 3), "stats": stats.model_dump()}
    text = (
        f"staged part {args.part} of {args.job}/{args.checkpoint_id}: {format_size(stats.logical_bytes)} "
        f"in {seconds:.1f}s; {stats.uploaded_chunks} of {stats.distinct_chunks} chunks new"
    )
    return _answer(args, as_json, text)


def commit(args: argparse.Namespace, store: ImageStore) -> int:
    job, checkpoint_id = parse_checkpoint_ref(args.checkpoint)
    expected = [part for part in args.expect.split(",") if part] or None
    manifest = store.commit_parts(job, checkpoint_id, expected)
    as_json = {
        "checkpoint": str(manifest.ref),
        "ranks": len(manifest.ranks),
        "stats": manifest.stats.model_dump(),
    }
    text = (
        f"committed {manifest.ref}: {len(manifest.ranks)} rank(s), "
        f"{format_size(manifest.stats.logical_bytes)}, {manifest.stats.files} files"
    )
    return _answer(args, as_json, text)


def download(args: argparse.Namespace, store: ImageStore) -> int:
    ref = _ref(store, args.checkpoint)
    manifest = store.manifest(ref)
    total = manifest.stats.logical_bytes
    with _progress(args, "download", total) as progress:
        report = store.restore(ref, args.directory, progress=progress)
    as_json = {
        "checkpoint": str(ref),
        "directory": str(args.directory),
        "bytes": report.logical_bytes,
        "chunks": report.chunks,
        "seconds": round(report.seconds, 3),
        "stages": {stage: round(value, 4) for stage, value in report.stages.items()},
    }
    text = (
        f"restored {ref} into {args.directory}: {format_size(report.logical_bytes)} in "
        f"{report.seconds:.1f}s ({_rate(report.logical_bytes, report.seconds)}), every chunk verified; "
        f"signature: {signature_state(manifest, store)}"
    )
    return _answer(args, as_json, text)
