"""A dump then its upload, against the same with the follower uploading the pages while they are written.

    .venv/bin/python bench/store_follow.py                   # 256 MiB, a SeaweedFS started for the run
    .venv/bin/python bench/store_follow.py --size 1GiB --rate 100MiB

A writer stands in for CRIU: it writes incompressible pages into one pages file, front to back, at a set
rate (by default about the rate this machine uploads at, measured first, so that the dump and the upload
take about as long: the case where overlapping them pays most). Then the store uploads the directory,
as the node agent does after a dump. The second run does the same with a follower (ibckpt/store/follow.py)
on the directory during the write, and the upload hashes every span again; the third takes the
follower's chunk ids for spans whose CRC32 still matches, as the node agent does. Each run has a prefix
of its own (no dedup between runs); each upload is restored and checked byte for byte. The S3 server
runs on the same machine, sharing its cores.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

from ibckpt.store import Credentials, ImageStore, Manifest, StoreConfig  # noqa: E402
from ibckpt.store.follow import FollowStats  # noqa: E402
from ibckpt.store.units import format_size, parse_size  # noqa: E402

MiB = 1024 * 1024
PIECE = MiB  # the writer's write size
# (follow, trust): without the follower; with it, every span hashed again; with it, its spans taken
RUNS = ((False, False), (True, False), (True, True))


@dataclass
class Run:
    label: str
    write: float  # seconds the writer took
    upload: float  # seconds from the end of the write to the upload's end (stopping the follower included)
    uploaded_chunks: int  # by the upload after the write
    stages: dict[str, float]  # the upload's, summed over its threads
    follower: FollowStats | None = None

    @property
    def total(self) -> float:
        return self.write + self.upload


def make_source(path: Path, size: int) -> None:
    with path.open("wb") as out:
        for offset in range(0, size, 16 * MiB):
            out.write(os.urandom(min(16 * MiB, size - offset)))


def write_paced(source: Path, target: Path, rate: float | None) -> float:
    """Copy source to target front to back, at `rate` bytes/s (None: as fast as the disk goes)."""
    start = time.perf_counter()
    with source.open("rb") as src, target.open("wb") as out:
        done = 0
        while piece := src.read(PIECE):
            out.write(piece)
            out.flush()
            done += len(piece)
            if rate:
                ahead = done / rate - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)
    return time.perf_counter() - start


def upload(store: ImageStore, root: Path, job: str, stats: FollowStats | None) -> tuple[float, Manifest]:
    start = time.perf_counter()
    with store.writer(job, followed=stats.spans if stats is not None else None) as writer:
        writer.add_tree(root)
        manifest = writer.commit()
    seconds = time.perf_counter() - start
    out = root.parent / "restored"
    store.restore(manifest.ref, out)
    with (out / "pages-1.img").open("rb") as back, (root / "pages-1.img").open("rb") as front:
        while piece := front.read(16 * MiB):
            assert back.read(16 * MiB) == piece, "restored bytes differ"
    shutil.rmtree(out)
    return seconds, manifest


def one_run(
    config: StoreConfig, source: Path, work: Path, rate: float | None, follow: bool, trust: bool = True
) -> Run:
    """trust: the upload takes the follower's chunk ids for spans whose CRC32 still matches (the agent's
    way); else it hashes every span again (before)."""
    store = ImageStore.open(config.with_overrides(prefix=f"{config.prefix}-{secrets.token_hex(3)}"))
    root = work / "dump"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    (root / "core-1.img").write_bytes(b"\x00core" * 100)
    follower = store.follow(root, "bench").start() if follow else None
    write = write_paced(source, root / "pages-1.img", rate)
    start = time.perf_counter()
    stats = follower.stop() if follower is not None else None
    stopping = time.perf_counter() - start
    seconds, manifest = upload(store, root, "bench", stats if trust else None)
    label = "dump, then upload"
    if follow:
        label += ", with the follower" + ("" if trust else " (hashed again)")
    return Run(label, write, stopping + seconds, manifest.stats.uploaded_chunks, manifest.timings, stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=parse_size, default=256 * MiB, help="pages file size (default 256MiB)")
    parser.add_argument("--rate", type=parse_size, help="the writer's bytes/s (default: the upload's)")
    parser.add_argument("--chunk-size", type=parse_size, default=8 * MiB)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)

    from testbed.s3 import start_s3, stop_s3

    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-", dir=args.workdir))
    server = start_s3(work / "s3")
    try:
        config = StoreConfig(
            bucket="ibckpt-bench",
            endpoint_url=server.endpoint,
            region="us-east-1",
            addressing_style="path",
            credentials=Credentials(
                access_key_id=SecretStr(server.access_key), secret_access_key=SecretStr(server.secret_key)
            ),
            chunk_size=args.chunk_size,
            workers=args.workers,
            prefix=f"bench-{secrets.token_hex(3)}",
        )
        server.client().create_bucket(Bucket=config.bucket)
        source = work / "pages.src"
        make_source(source, args.size)
        rate = args.rate
        if rate is None:
            calibration = one_run(config, source, work, None, follow=False)
            rate = int(args.size / calibration.upload)
            print(f"calibration: the upload alone took {calibration.upload:.1f}s", flush=True)
        runs = [one_run(config, source, work, rate, follow, trust) for follow, trust in RUNS]
        plain, hashed_again, followed = runs
        print(f"\npages: {format_size(args.size)} incompressible, written at {format_size(rate)}/s\n")
        print(f"{'run':<56} {'write':>7} {'upload':>7} {'total':>7} {'chunks PUT after':>17}")
        for run in runs:
            print(
                f"{run.label:<56} {run.write:>6.1f}s {run.upload:>6.1f}s {run.total:>6.1f}s"
                f" {run.uploaded_chunks:>17}"
            )
        print("\nthe upload after the write, per stage summed over threads: CPU s / elapsed s")
        for run in runs:
            stages = ("read", "verify", "hash", "exists", "compress", "put")
            names = [name for name in stages if name in run.stages]
            parts = [
                f"{name} {run.stages.get(name + '_cpu', 0):.1f}/{run.stages[name]:.1f}" for name in names
            ]
            print(f"  {run.label:<56} " + ", ".join(parts))
        stats = followed.follower
        assert stats is not None
        print(
            f"\nthe follower stored {stats.stored_chunks} chunks ({format_size(stats.stored_bytes)}) "
            f"during the write, {stats.failed_chunks} failed"
        )
        ideal = max(plain.write, plain.upload) / plain.total
        print(
            f"with the follower / without: {followed.total / plain.total:.2f}x "
            f"(hashed again: {hashed_again.total / plain.total:.2f}x; "
            f"max(write, upload) / their sum: {ideal:.2f}x)"
        )
    finally:
        stop_s3(server)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
