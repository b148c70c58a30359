"""Image store throughput, side by side with a raw boto3 transfer of the same bytes and a plain local copy.

    .venv/bin/python bench/store_throughput.py                 # 2 GiB, a SeaweedFS started for the run
    .venv/bin/python bench/store_throughput.py --size 512MiB   # smaller
    .venv/bin/python bench/store_throughput.py --endpoint URL --bucket B   # an existing S3 (AWS_* creds)
    .venv/bin/python bench/store_throughput.py --encrypt      # the store's runs encrypt client-side

The image is a directory of files like a CRIU dump's pages: by default half random bytes (numerical data,
which does not compress) and half text-like records (which does). Every run uploads the same bytes and
downloads them again into a fresh directory; every download is checked byte for byte against the source.
For the store's runs, CPU and elapsed seconds per stage (summed over threads) say where the time goes, and
the process CPU time says how busy the cores were. The S3 server runs on the same machine.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig
from pydantic import SecretBytes, SecretStr

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

from ibckpt.store import Credentials, EncryptionConfig, ImageStore, StoreConfig  # noqa: E402
from ibckpt.store.units import format_size, parse_size  # noqa: E402

MiB = 1024 * 1024


@dataclass
class Phase:
    seconds: float
    cpu_seconds: float
    stages: dict[str, float] = field(default_factory=dict)


@dataclass
class Row:
    method: str
    upload: Phase
    download: Phase
    stored_bytes: int | None = None


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(action: Callable[[], Any]) -> tuple[Phase, Any]:
    cpu, wall = cpu_seconds(), time.perf_counter()
    result = action()
    return Phase(time.perf_counter() - wall, cpu_seconds() - cpu), result


def make_image(root: Path, size: int, file_size: int, compressible_share: float) -> None:
    """Files of `file_size` bytes; the first `compressible_share` of the bytes are text-like records."""
    root.mkdir(parents=True)
    written, index = 0, 0
    while written < size:
        length = min(file_size, size - written)
        path = root / f"pages-{index:03}.img"
        with open(path, "wb") as handle:
            if written < size * compressible_share:
                record = f"rank {index} step {{:>9}} residual {{:.6e}} converged false\n"
                block = "".join(record.format(step, 1.0 / (step + 1)) for step in range(16384)).encode()
                for offset in range(0, length, len(block)):
                    handle.write(block[: min(len(block), length - offset)])
            else:
                for offset in range(0, length, 16 * MiB):
                    handle.write(os.urandom(min(16 * MiB, length - offset)))
        written += length
        index += 1
    (root / "core-1.img").write_bytes(b"\x00core" * 100)


def same_tree(left: Path, right: Path) -> bool:
    names = sorted(path.name for path in left.iterdir())
    return names == sorted(path.name for path in right.iterdir()) and all(
        filecmp.cmp(left / name, right / name, shallow=False) for name in names
    )


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def run_local_copy(image: Path, work: Path) -> Row:
    first, second = work / "copy-1", work / "copy-2"
    up, _ = timed(lambda: shutil.copytree(image, first))
    down, _ = timed(lambda: shutil.copytree(first, second))
    assert same_tree(image, second)
    drop(first)
    drop(second)
    return Row("local copy (shutil.copytree)", up, down)


def run_raw_boto3(store: ImageStore, image: Path, work: Path, workers: int) -> Row:
    client, bucket = store.client, store.config.bucket
    prefix = f"bench-raw-{secrets.token_hex(3)}/"
    config = TransferConfig(multipart_chunksize=8 * MiB, max_concurrency=workers)
    files = sorted(image.iterdir())

    def upload() -> None:
        for path in files:
            client.upload_file(str(path), bucket, prefix + path.name, Config=config)

    def download() -> None:
        out = work / "raw-out"
        out.mkdir()
        for path in files:
            client.download_file(bucket, prefix + path.name, str(out / path.name), Config=config)

    up, _ = timed(upload)
    down, _ = timed(download)
    assert same_tree(image, work / "raw-out")
    drop(work / "raw-out")
    for path in files:
        client.delete_object(Bucket=bucket, Key=prefix + path.name)
    return Row("raw boto3 upload_file/download_file", up, down, sum(path.stat().st_size for path in files))


def run_store(config: StoreConfig, image: Path, work: Path, label: str, job: str, prefix: str) -> Row:
    store = ImageStore.open(config.with_overrides(prefix=prefix))
    up, manifest = timed(lambda: store.upload_tree(image, job))
    up.stages = {stage: value for stage, value in manifest.timings.items() if stage != "total"}
    out = work / "store-out"
    down, report = timed(lambda: store.restore(manifest.ref, out))
    down.stages = dict(report.stages)
    assert same_tree(image, out)
    drop(out)
    return Row(label, up, down, manifest.stats.uploaded_bytes)


def print_table(rows: list[Row], size: int) -> None:
    base = next(row for row in rows if row.method.startswith("raw boto3"))
    print(f"\nimage: {format_size(size)}\n")
    header = (
        f"{'method':<44} {'upload':>11} {'vs raw':>7} {'cpu':>6} {'download':>11} {'vs raw':>7} {'cpu':>6}"
    )
    print(header + f" {'sent':>10}")
    print("-" * (len(header) + 11))
    for row in rows:
        up_rate, down_rate = size / row.upload.seconds, size / row.download.seconds
        up_ratio = base.upload.seconds / row.upload.seconds
        print(
            f"{row.method:<44} {format_size(up_rate) + '/s':>11} {up_ratio:>6.2f}x"
            f" {row.upload.cpu_seconds:>5.1f}s {format_size(down_rate) + '/s':>11}"
            f" {base.download.seconds / row.download.seconds:>6.2f}x {row.download.cpu_seconds:>5.1f}s"
            f" {format_size(row.stored_bytes) if row.stored_bytes is not None else '-':>10}"
        )
    print("\nwhere the time goes in the store, per stage summed over threads: CPU s / elapsed s")
    print("(elapsed includes waiting for the server and for a core; network stages use little CPU)")
    for row in rows:
        if not row.upload.stages:
            continue
        print(f"  {row.method}")
        for name, phase in (("upload", row.upload), ("download", row.download)):
            stages = [stage for stage in phase.stages if not stage.endswith("_cpu")]
            # Two decimals: at a few hundred MiB, most stages take well under a tenth of a CPU second.
            parts = [
                f"{stage} {phase.stages.get(stage + '_cpu', 0):.2f}/{phase.stages[stage]:.1f}"
                for stage in stages
            ]
            print(
                f"    {name:<8} wall {phase.seconds:.1f}s, process CPU {phase.cpu_seconds:.2f}s: "
                + ", ".join(parts)
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=parse_size, default=2 * 1024 * MiB, help="image size (default 2GiB)")
    parser.add_argument("--file-size", type=parse_size, default=256 * MiB, help="size of each image file")
    parser.add_argument("--compressible", type=float, default=0.5, help="share of text-like bytes (0..1)")
    parser.add_argument("--chunk-size", type=parse_size, default=8 * MiB)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--level", type=int, default=3, help="zstd level of the compressed run")
    parser.add_argument("--encrypt", action="store_true", help="the store encrypts client-side (AES-GCM)")
    parser.add_argument("--endpoint", help="use this S3 instead of starting SeaweedFS (credentials: AWS_*)")
    parser.add_argument("--bucket", default="ibckpt-bench")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-", dir=args.workdir))
    server = None
    try:
        if args.endpoint:
            endpoint, credentials = args.endpoint, None
        else:
            from testbed.s3 import start_s3

            server = start_s3(work / "s3")
            endpoint = server.endpoint
            credentials = Credentials(
                access_key_id=SecretStr(server.access_key), secret_access_key=SecretStr(server.secret_key)
            )
        base = StoreConfig(
            bucket=args.bucket,
            endpoint_url=endpoint,
            region="us-east-1",
            addressing_style="path",
            credentials=credentials,
            chunk_size=args.chunk_size,
            workers=args.workers,
            prefix=f"bench-{secrets.token_hex(3)}",
        )
        if args.encrypt:
            key = SecretBytes(os.urandom(32))
            base = base.with_overrides(encryption=EncryptionConfig(mode="client", client_key=key))
        if server is not None:
            server.client().create_bucket(Bucket=args.bucket)
        image = work / "image"
        print(f"generating a {format_size(args.size)} image in {image} ...", flush=True)
        make_image(image, args.size, args.file_size, args.compressible)
        size = sum(path.stat().st_size for path in image.iterdir())

        rows = [run_local_copy(image, work)]
        print("local copy done", flush=True)
        rows.append(run_raw_boto3(ImageStore.open(base), image, work, args.workers))
        print("raw boto3 done", flush=True)
        compressed = base.with_overrides(compression_level=args.level)
        # Each run gets its own prefix (no dedup between runs), except the unchanged second checkpoint.
        zstd_label, zstd_prefix = f"ibckpt store, zstd level {args.level}", base.prefix + "-zstd"
        rows.append(run_store(compressed, image, work, zstd_label, "bench", zstd_prefix))
        print("store (compressed) done", flush=True)
        plain = base.with_overrides(compression_level=0)
        rows.append(
            run_store(plain, image, work, "ibckpt store, no compression", "bench", base.prefix + "-raw")
        )
        print("store (uncompressed) done", flush=True)
        second = "ibckpt store, unchanged 2nd checkpoint"
        rows.append(run_store(compressed, image, work, second, "bench", zstd_prefix))
        print_table(rows, size)
        if args.json:
            args.json.write_text(json.dumps({"size": size, "rows": [asdict(row) for row in rows]}, indent=2))
    finally:
        if server is not None:
            from testbed.s3 import stop_s3

            stop_s3(server)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
