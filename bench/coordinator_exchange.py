"""Time the coordinator's id exchange for a simulated job (goal: < 1 s for 2,048 ranks on 128 nodes).

Run: .venv/bin/python bench/coordinator_exchange.py [--nodes 128] [--ranks-per-node 16]
All-to-all: every rank has one QP toward every rank on another node (~4M records of 72 bytes
for 2,048 ranks). Record generation is excluded; the time is from the first publish until
every node holds its records, through a real server and 128 TCP clients on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from ibckpt.coordination.ranks import QP_RECORD
from ibckpt_operator.coordinator.simulation import run_exchange, segments_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ranks-per-node", type=int, default=16)
    args = parser.parse_args()
    print(f"{'nodes':>6} {'ranks':>6} {'records':>10} {'MiB':>8} {'exchange s':>11} {'MiB/s':>8}")
    for nodes in sorted({2, 16, args.nodes}):
        per = args.ranks_per_node
        t0 = time.monotonic()
        prepared = [segments_for(n, nodes, per) for n in range(nodes)]
        gen = time.monotonic() - t0
        size = sum(len(b) for seg in prepared for b in seg.values())
        _, seconds = asyncio.run(run_exchange(nodes, per, prepared))
        mib = size / 2**20
        print(
            f"{nodes:>6} {nodes * per:>6} {size // QP_RECORD.size:>10} {mib:>8.1f} {seconds:>11.3f} "
            f"{mib / seconds:>8.0f}   (generating the records took {gen:.1f} s, not counted)"
        )


if __name__ == "__main__":
    main()
