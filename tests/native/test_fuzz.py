"""libFuzzer runs of the shim's parsers, bounded in time (issue 16): the rebuild records a rank
reads from the coordinator, the control protocol's input side (line framing and command parsing),
and the follower of librdmacm's ids (the commands and events of rdma/rdma_user_cm.h). Built with
clang, ASan and UBSan; a finding fails the test with its reproducer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from shimtest import BUILD_DIR, NATIVE_DIR

SECONDS = 20


@pytest.mark.parametrize("target", ["records", "control", "cmstate"])
def test_fuzz_parser(tmp_path: Path, target: str) -> None:
    subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "fuzz"], check=True)
    corpus = tmp_path / "corpus"
    # the seeds are copied: libFuzzer writes the inputs it finds into its corpus
    shutil.copytree(NATIVE_DIR / "fuzz" / "corpus" / target, corpus)
    proc = subprocess.run(
        [
            str(BUILD_DIR / "fuzz" / f"fuzz_{target}"),
            f"-max_total_time={SECONDS}",
            f"-artifact_prefix={tmp_path}/",
            "-print_final_stats=1",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS * 10,
    )
    findings = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "leak-", "oom-")))
    assert proc.returncode == 0 and findings == [], proc.stderr[-4000:]
    runs = [ln for ln in proc.stderr.splitlines() if ln.startswith("stat::number_of_executed_units")]
    assert runs and int(runs[0].split(":")[-1]) > 10_000, proc.stderr[-2000:]  # it really ran
