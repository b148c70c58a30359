"""The memory tier against S3, side by side in one run (docs/recovery.md, "Tiers").

    .venv/bin/python bench/memory_tier.py                     # 64 MiB and 256 MiB parts
    .venv/bin/python bench/memory_tier.py --sizes 1GiB --mtbf-hours 12

For each size, one node's part (incompressible pages plus small CRIU-like files) is committed twice:
1. on S3 (commitOn: S3), as the agent stages it and the operator commits it: stage_part (chunk,
   compress, PUT, the signed part) then commit_parts (the merged, signed manifest);
2. on the memory tier (commitOn: Memory): memorycopies.keep_first (the part sealed chunk by chunk and
   streamed over the agents' TLS to a real agent server's shelf, sealed with its signed part manifest),
   then what the operator does: the part manifest read back from the holder, commit_in_memory (merged
   and signed, no S3 call) and the signed manifest put on the holder;
3. restored from S3, then restored from memory alone (memory_only: the manifest and every chunk from
   the holder, no S3 client).
It prints the ratios memory/S3 and the Young/Daly interval sqrt(2 * C * MTBF) under each cost C. The S3
server (SeaweedFS) and the holder agent run on this machine: both paths cross loopback, so the ratios say
what ibckpt's own work costs on each path, not what a real network or a remote bucket would add.
"""

from __future__ import annotations

import argparse
import base64
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher and the agent harness the tests use

from agent.agent_harness import IMAGE_KEYS  # noqa: E402

from ibckpt.agentapi import ImageDestination, MemoryCopySource, MemoryCopyTarget, SecretRef  # noqa: E402
from ibckpt.api import S3Location  # noqa: E402
from ibckpt.store import CheckpointRef, ImageStore  # noqa: E402
from ibckpt.store.parts import commit_in_memory  # noqa: E402
from ibckpt.store.units import format_size, parse_size  # noqa: E402
from ibckpt.tls import client_context  # noqa: E402
from ibckpt_node.agent import memorycopies  # noqa: E402
from ibckpt_node.agent.staging import stage_part, store_config  # noqa: E402
from testbed.s3 import S3Server, start_s3, stop_s3  # noqa: E402

MiB = 1024 * 1024
# The holder: a real agent server in its own process, as on another node (in this one, its TLS would
# share the restoring threads' interpreter lock, which SeaweedFS does not).
HOLDER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from agent.agent_harness import Running
holder = Running(Path(sys.argv[2]), node="node-2", memory_budget=int(sys.argv[3]))
Path(sys.argv[2] + ".ca").write_bytes(holder.pki.ca.ca_crt)
print(holder.port, flush=True)
sys.stdin.read()
holder.stop()
"""


class Holder:
    def __init__(self, state: Path, budget: int) -> None:
        args = [sys.executable, "-c", HOLDER, str(REPO / "tests"), str(state), str(budget)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.tls = client_context(Path(str(state) + ".ca").read_bytes())

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def images(root: Path, size: int) -> Path:
    tree = root / "images" / "solver-0.main"
    tree.mkdir(parents=True)
    (tree / "pages-1.img").write_bytes(os.urandom(size))
    for n in range(40):
        (tree / f"fdinfo-{n}.img").write_bytes(b"fd %d\n" % n * (20 + n))
    return root / "images"


def one_size(s3: S3Server, holder: Holder, token: Path, size: int, work: Path) -> dict[str, float]:
    bucket = "bench-" + secrets.token_hex(4)
    s3.create_bucket(bucket)
    location = S3Location.model_validate({"endpoint": s3.endpoint, "region": s3.region, "bucket": bucket,
                                          "credentialsSecretRef": {"name": "s3"}})  # fmt: skip
    destination = ImageDestination(location=location, credentials=SecretRef(namespace="b", name="s3"),
                                   job="bench/solver", checkpoint_id="c1")  # fmt: skip
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    config = store_config(location, destination.credentials, {k: base64.b64encode(v.encode()).decode()
                                                              for k, v in keys.items()})  # fmt: skip
    root = images(work, size)
    trees = [("solver-0.main", "solver-0")]
    t = time.perf_counter()
    staged = stage_part(config, destination, "node-1", root, trees, lambda n: None, IMAGE_KEYS)
    staged.store.commit_parts("bench/solver", "c1", ["node-1"])
    upload = time.perf_counter() - t
    # the same part committed on the memory tier, as checkpoint c2: what commitOn Memory does
    destination = destination.model_copy(update={"checkpoint_id": "c2"})
    target = MemoryCopyTarget(node="node-2", address=f"127.0.0.1:{holder.port}", first=True)
    holder_client = memorycopies.client(target.address, token, holder.tls)
    t = time.perf_counter()
    kept = memorycopies.keep_first(config, destination, "node-1", root, trees, IMAGE_KEYS, None, target,
                                   token, holder.tls, time.monotonic() + 3600)  # fmt: skip
    assert kept.kept, kept.message
    part = holder_client.part_manifest("bench/solver", "c2", "node-1")
    assert part is not None
    offline = ImageStore.offline(staged.store.config, signing=IMAGE_KEYS)
    _, signed = commit_in_memory(offline.context, "bench/solver", "c2", {"node-1": part}, ["node-1"])
    holder_client.put_manifest("bench/solver", "c2", signed)
    copy = time.perf_counter() - t
    store = ImageStore.open(staged.store.config, signing=IMAGE_KEYS)
    t = time.perf_counter()
    store.restore(staged.part.ref, work / "from-s3", subtree="node-1/solver-0.main")
    from_s3 = time.perf_counter() - t
    # a memory-only restore: the manifest and every chunk from the holder, no S3 client
    source = MemoryCopySource(node="node-2", address=target.address, part="node-1")
    reader = memorycopies.CopyReader("bench/solver", "c2", [(source, holder_client)])
    ref = CheckpointRef("bench/solver", "c2")
    t = time.perf_counter()
    manifest = memorycopies.read_manifest(offline, ref, reader)
    report = offline.restore(ref, work / "from-memory", subtree="node-1/solver-0.main", chunk_source=reader,
                             manifest=manifest, source_only=True)  # fmt: skip
    from_memory = time.perf_counter() - t
    assert report.source_chunks == report.chunks, (report.source_chunks, report.chunks)
    for name in ("pages-1.img", "fdinfo-7.img"):
        original = (root / "solver-0.main" / name).read_bytes()
        assert (
            (work / "from-s3" / name).read_bytes() == original == (work / "from-memory" / name).read_bytes()
        )
    holder_client.drop("bench/solver", "c2")
    return {"upload": upload, "copy": copy, "from_s3": from_s3, "from_memory": from_memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64MiB,256MiB", help="comma-separated part sizes")
    parser.add_argument("--mtbf-hours", type=float, default=24.0, help="for the Young/Daly interval")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ibckpt-bench-memory-"))
    token = work / "token"
    token.write_text("agent-token")
    s3 = start_s3(work / "s3")
    holder = Holder(work / "holder", 2 * max(sizes) + 64 * MiB)
    mtbf = args.mtbf_hours * 3600
    try:
        for size in sizes:
            run = work / f"run-{size}"
            run.mkdir()
            r = one_size(s3, holder, token, size, run)
            shutil.rmtree(run)
            mb = size / MiB
            interval = {k: math.sqrt(2 * r[k] * mtbf) / 60 for k in ("upload", "copy")}
            print(f"part of {format_size(size)}:")
            ratio = r["copy"] / r["upload"]
            print(f"  commit cost  on S3 {r['upload']:.2f}s ({mb / r['upload']:.0f} MB/s), on memory "
                  f"{r['copy']:.2f}s ({mb / r['copy']:.0f} MB/s): ratio {ratio:.2f}")  # fmt: skip
            print(f"  restore      from S3 {r['from_s3']:.2f}s ({mb / r['from_s3']:.0f} MB/s), from memory "
                  f"{r['from_memory']:.2f}s ({mb / r['from_memory']:.0f} MB/s): "
                  f"ratio {r['from_memory'] / r['from_s3']:.2f}")  # fmt: skip
            print(f"  Young/Daly interval at MTBF {args.mtbf_hours:g} h: {interval['upload']:.1f} min "
                  f"committing on S3, {interval['copy']:.1f} min committing on memory")  # fmt: skip
    finally:
        holder.stop()
        stop_s3(s3)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
