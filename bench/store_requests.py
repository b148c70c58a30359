"""S3 requests and seconds of one small checkpoint through the store, against one PUT/GET of a tar of it.

    .venv/bin/python bench/store_requests.py              # a SeaweedFS on 127.0.0.1 started for the run
    .venv/bin/python bench/store_requests.py --repeat 15

The tree is shaped like a CRIU image directory: 80 small files (200 B to 20 KB, half of them protobuf-like
records, half random), one 1 MB pages file and one 64 KB file. Each layout uploads it as a job's first
checkpoint, then a second checkpoint in which the small files changed (CRIU rewrites them at every dump)
and the pages did not, and restores both; every restore is compared with its source. The old layout is the
store with packing and blind PUTs off (IBCKPT_PACK_BELOW=0, IBCKPT_BLIND_PUT_BELOW=0: one chunk per file,
a HEAD before each PUT); the new one is the defaults. The raw baseline is one boto3 put_object/get_object of
an uncompressed tar of the same tree (the tar is built before the clock starts), on the same client; a
second raw row includes building the tar and extracting it to disk.

Requests are HTTP requests as sent (botocore's before-send event, retries included); every request costs a
signature and a parse, which is what dominates on slow (emulated) nodes, so client CPU is shown next to
the wall time. Times are medians over --repeat runs.
"""

from __future__ import annotations

import argparse
import filecmp
import io
import random
import secrets
import shutil
import statistics
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

from ibckpt.store import ImageStore  # noqa: E402

BUCKET = "ibckpt-bench"


class Counter:
    """HTTP requests a client sends, from every thread."""

    def __init__(self, client: Any) -> None:
        self._lock = threading.Lock()
        self.sent: list[str] = []
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request: Any, **_: Any) -> None:
        with self._lock:
            self.sent.append(request.method)

    def take(self) -> int:
        with self._lock:
            count, self.sent = len(self.sent), []
        return count


@dataclass
class Sample:
    requests: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, requests: int, seconds: float, cpu: float) -> None:
        self.requests.append(requests)
        self.seconds.append(seconds)
        self.cpu.append(cpu)

    def median(self) -> tuple[float, float, float]:
        return (
            statistics.median(self.requests),
            statistics.median(self.seconds),
            statistics.median(self.cpu),
        )


def measure(counter: Counter, sample: Sample, action: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    counter.take()
    cpu, wall = time.process_time(), time.perf_counter()
    result = action(*args, **kwargs)
    sample.add(counter.take(), time.perf_counter() - wall, time.process_time() - cpu)
    return result


def record_bytes(rng: random.Random, size: int) -> bytes:
    """Protobuf-like: short tagged fields, small integers, repeated names."""
    out = bytearray()
    while len(out) < size:
        out += bytes([0x08, rng.randrange(128), 0x12, 6]) + b"fdinfo" + rng.randbytes(4)
    return bytes(out[:size])


def make_tree(root: Path, seed: int, pages: bytes) -> None:
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for index in range(80):
        size = rng.randrange(200, 20_001)
        data = record_bytes(rng, size) if index % 2 else rng.randbytes(size)
        (root / f"img-{index:02}.img").write_bytes(data)
    (root / "pages-1.img").write_bytes(pages)
    (root / "mm-1.img").write_bytes(rng.randbytes(64 * 1024))


def tar_of(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(root, arcname=".")
    return buffer.getvalue()


def same_tree(left: Path, right: Path) -> bool:
    names = sorted(path.name for path in left.iterdir())
    return names == sorted(path.name for path in right.iterdir()) and all(
        filecmp.cmp(left / name, right / name, shallow=False) for name in names
    )


@dataclass
class Row:
    label: str
    up: Sample = field(default_factory=Sample)
    down: Sample = field(default_factory=Sample)


def get_bytes(client: Any, bucket: str, key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def put_tar(client: Any, bucket: str, key: str, tree: Path) -> None:
    client.put_object(Bucket=bucket, Key=key, Body=tar_of(tree))


def get_untar(client: Any, bucket: str, key: str, out: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(get_bytes(client, bucket, key))) as tar:
        tar.extractall(out, filter="tar")


def run_raw(store: ImageStore, counter: Counter, trees: list[Path], rows: list[Row], work: Path) -> None:
    """rows[0]: the transfer alone (the tar built before, kept in memory after); rows[1]: with the tar
    built from the tree and extracted to disk, as a raw restore would need."""
    client, bucket = store.client, store.config.bucket
    for tree in trees:
        body, key = tar_of(tree), f"raw-{secrets.token_hex(4)}.tar"
        measure(counter, rows[0].up, client.put_object, Bucket=bucket, Key=key, Body=body)
        got = measure(counter, rows[0].down, get_bytes, client, bucket, key)
        assert got == body
        measure(counter, rows[1].up, put_tar, client, bucket, key, tree)
        out = work / ("raw-" + secrets.token_hex(3))
        measure(counter, rows[1].down, get_untar, client, bucket, key, out)
        assert same_tree(tree, out)
        shutil.rmtree(out)


def run_store(store: ImageStore, counter: Counter, trees: list[Path], rows: list[Row], work: Path) -> None:
    job = "bench-" + secrets.token_hex(3)  # a fresh job: its first checkpoint, then a second
    for tree, row in zip(trees, rows, strict=True):
        manifest = measure(counter, row.up, store.upload_tree, tree, job)
        out = work / ("out-" + secrets.token_hex(3))
        measure(counter, row.down, store.restore, manifest.ref, out)
        assert same_tree(tree, out), f"{out} differs from {tree}"
        shutil.rmtree(out)


def print_table(rows: list[Row], size: int) -> None:
    raw = rows[0]
    print(f"\ntree: 82 files, {size / 1e6:.2f} MB; medians; x = ratio to the raw tar PUT/GET\n")
    print(f"{'':34} {'upload':^40} {'download':^40}")
    columns = f"{'requests':>12} {'seconds':>14} {'cpu s':>12}"
    print(f"{'':34} {columns} {columns}")
    for row in rows:
        cells = []
        for sample, base in ((row.up, raw.up), (row.down, raw.down)):
            (requests, seconds, cpu), (b_requests, b_seconds, b_cpu) = sample.median(), base.median()
            cells.append(
                f"{requests:>4.0f} {requests / b_requests:>6.1f}x"
                f" {seconds:>7.3f} {seconds / b_seconds:>5.1f}x {cpu:>5.3f} {cpu / b_cpu:>5.1f}x"
            )
        print(f"{row.label:<34} {cells[0]} {cells[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=9, help="runs of each method (default 9)")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)

    from testbed.s3 import start_s3, stop_s3

    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-requests-"))
    server = start_s3(work / "s3")
    try:
        server.create_bucket(BUCKET)
        pages = random.Random(1).randbytes(1_000_000)
        first, second = work / "ckpt-1", work / "ckpt-2"
        make_tree(first, seed=1, pages=pages)
        make_tree(second, seed=2, pages=pages)  # the small files changed, the pages did not
        size = sum(path.stat().st_size for path in first.iterdir())
        base = server.store_config(BUCKET, workers=args.workers, prefix="bench-" + secrets.token_hex(3))
        layouts = {
            "store, old layout": base.with_overrides(pack_below=0, blind_put_below=0),
            "store, packs": base,
        }
        raw = [Row("raw tar, one PUT / one GET"), Row("raw tar, tar+PUT / GET+untar")]
        rows = {label: [Row(f"{label}, 1st ckpt"), Row(f"{label}, 2nd ckpt")] for label in layouts}
        raw_store = ImageStore.open(base)
        raw_counter = Counter(raw_store.client)
        for run in range(args.repeat):
            # Interleaved, so that a change in the machine's load hits every method alike.
            run_raw(raw_store, raw_counter, [first, second], raw, work)
            for label, config in layouts.items():
                # A prefix of its own: no chunk of an earlier run is in the bucket.
                store = ImageStore.open(config.with_overrides(prefix=f"{config.prefix}-{label[7:10]}-{run}"))
                run_store(store, Counter(store.client), [first, second], rows[label], work)
            print(f"run {run + 1}/{args.repeat} done", flush=True)
        print_table([*raw, *(row for pair in rows.values() for row in pair)], size)
        print("\nImageStore.open() checks the bucket with one more request (HEAD bucket), not counted above.")
    finally:
        stop_s3(server)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] if len(sys.argv) > 1 else None))
