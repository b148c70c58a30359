"""`make demo`: checkpoint a running two-node RDMA job, store it in S3, and restore it swapped.

1. SeaweedFS S3 and a kube-apiserver (with the ibckpt CRDs) on 127.0.0.1, and a job
   coordinator on the host.
2. Two qemu guests, node-1 and node-2, joined by a private link (Soft-RoCE over RoCEv2).
   Rank 0 of a verbs job (`rc_seq` under libibckpt.so: sequence-numbered, checksummed RC
   traffic both ways) runs on node-1, rank 1 on node-2.
3. Mid-traffic, each node agent quiesces, drains and releases its rank's verbs state, dumps
   it with CRIU, and stages the images in S3; the host commits the checkpoint.
4. Both guests are powered off. Two fresh guests download the checkpoint and restore each
   rank on the OTHER node (new GIDs, QPNs and keys); the queue pairs are rebuilt through the
   coordinator and the job finishes. Counts and checksums must show every message delivered
   exactly once.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import kubernetes
import yaml
from rich.console import Console
from rich.table import Table

from ibckpt.store import ImageStore
from ibckpt.store.config import config_from_env, credentials_from_secret
from ibckpt.store.manifest import Manifest
from ibckpt_native import SHIM, TESTS_DIR
from ibckpt_native.harness import parse_result
from testbed.coordinator import ThreadedCoordinator
from testbed.guest import GUEST_HOST_ADDR, REPO, GuestResult, GuestSpec, run_pair
from testbed.kube import start_control_plane
from testbed.s3 import S3Server, start_s3, stop_s3

BUCKET = "ibckpt-demo"
JOB = "demo/ring"
CHECKPOINT = "c1"
# rank key -> (rank, role, node it starts on, node it is restored on)
RANKS = {
    "ring/rank-0/main/0": (0, "server", 1, 2),
    "ring/rank-1/main/0": (1, "client", 2, 1),
}

NODE_ROLES = """
set -eu
mkdir -p /run/ibckpt
case "$IBCKPT_NODE:{phase}" in
  1:1|2:2) role=server; key=ring/rank-0/main/0; rank=0; peer="" ;;
  2:1|1:2) role=client; key=ring/rank-1/main/0; rank=1; peer="-c 10.77.0.1" ;;
esac
dir=$(echo $key | tr / _)
"""

CHECKPOINT_SCRIPT = (
    NODE_ROLES
    + """
# Push the pid counter up so that the restore's helpers never take the ranks' pids.
for _ in $(seq 300); do /bin/true; done
[ $role = client ] && sleep 1
LD_PRELOAD={shim} IBCKPT_CTL=/run/ibckpt/$role.ctl IBCKPT_COORD=unix:/run/ibckpt/coord.sock \\
  setsid {rc_seq} -f {work}/stop -p 18515 $peer </dev/null >{work}/$role.out 2>{work}/$role.err &
pid=$!
for _ in $(seq 600); do grep -q READY {work}/$role.out 2>/dev/null && break; sleep 0.1; done
grep -q READY {work}/$role.out
sleep 3  # traffic in flight when the checkpoint starts
{python} -m ibckpt_node.agent_cli checkpoint --coordinator {addr}:{coord_port} --session {session} \\
  --node node-$IBCKPT_NODE --rank "$key=$pid:/run/ibckpt/$role.ctl" --images /var/tmp/images --mode Stop \\
  > {work}/checkpoint-node-$IBCKPT_NODE.json
{ibckpt} images stage /var/tmp/images/$dir --job {job} --id {ckpt} --part node-$IBCKPT_NODE \\
  --under $dir --rank $rank --node node-$IBCKPT_NODE -o json > {work}/stage-node-$IBCKPT_NODE.json
echo "node-$IBCKPT_NODE: rank $rank ($role) checkpointed and staged in S3"
"""
)

RESTORE_SCRIPT = (
    NODE_ROLES
    + """
{ibckpt} images download {job}/{ckpt} /var/tmp/restore -o json > {work}/download-node-$IBCKPT_NODE.json
{python} -m ibckpt_node.agent_cli restore --coordinator {addr}:{coord_port} --session {session} \\
  --node node-$IBCKPT_NODE --rank "$key=/var/tmp/restore/$dir:/run/ibckpt/$role.ctl" --epoch 2 \\
  > {work}/restore-node-$IBCKPT_NODE.json
echo "node-$IBCKPT_NODE: rank $rank ($role) restored from S3"
sleep 3  # traffic after the move
touch {work}/stop
for _ in $(seq 600); do grep -q RESULT {work}/$role.out 2>/dev/null && break; sleep 0.1; done
grep RESULT {work}/$role.out
"""
)


def _guest_env(s3: S3Server, coordinator_token: str) -> dict[str, str]:
    port = s3.endpoint.rsplit(":", 1)[1]
    return {
        "IBCKPT_SESSION_TOKEN": coordinator_token,
        "IBCKPT_S3_ENDPOINT": f"http://{GUEST_HOST_ADDR}:{port}",
        "IBCKPT_S3_BUCKET": BUCKET,
        "IBCKPT_S3_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
    }


def _on_both_nodes(
    template: str, phase: int, work: Path, s3: S3Server, coordinator: ThreadedCoordinator
) -> tuple[GuestResult, GuestResult]:
    session, token = coordinator.create_session({"node-1", "node-2"})
    s3_port = int(s3.endpoint.rsplit(":", 1)[1])
    script = template.format(
        phase=phase,
        shim=SHIM,
        rc_seq=TESTS_DIR / "rc_seq",
        work=work,
        python=sys.executable,
        ibckpt=Path(sys.executable).parent / "ibckpt",
        addr=GUEST_HOST_ADDR,
        coord_port=coordinator.port,
        session=session,
        job=JOB,
        ckpt=CHECKPOINT,
    )
    spec = GuestSpec(
        script, writable=[work], forward_ports=[coordinator.port, s3_port], env=_guest_env(s3, token)
    )
    return run_pair(spec, spec, timeout=900)


def _failed(console: Console, results: tuple[GuestResult, GuestResult], work: Path, what: str) -> bool:
    bad = [r for r in results if r.returncode != 0]
    for r in bad:
        console.print(f"[red]{what} failed on node-{r.node} (exit {r.returncode}); console tail:[/red]")
        console.print(r.output[-3000:], markup=False)
    if bad:
        for log in sorted(work.glob("*.err")):
            console.print(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}", markup=False)
    return bool(bad)


def run(console: Console, work: Path) -> bool:
    s3 = start_s3()
    plane = start_control_plane()
    coordinator = ThreadedCoordinator()
    coordinator.start()
    try:
        console.print(f"S3 (SeaweedFS, SigV4): {s3.endpoint}")
        console.print(f"kube-apiserver (RBAC): {plane.url}")
        api = kubernetes.config.new_client_from_config(str(plane.kubeconfig))  # type: ignore[no-untyped-call]
        ext = kubernetes.client.ApiextensionsV1Api(api)
        for crd in sorted((REPO / "crds").glob("*.yaml")):
            ext.create_custom_resource_definition(yaml.safe_load(crd.read_text()))
        names = [str(c.metadata and c.metadata.name) for c in ext.list_custom_resource_definition().items]
        console.print(f"CRDs installed: {', '.join(sorted(names))}")
        console.print(f"job coordinator: 127.0.0.1:{coordinator.port}")
        s3.create_bucket(BUCKET)

        console.rule("checkpoint: rank 0 on node-1, rank 1 on node-2")
        started = time.monotonic()
        results = _on_both_nodes(CHECKPOINT_SCRIPT, 1, work, s3, coordinator)
        if _failed(console, results, work, "checkpoint"):
            return False
        manifest = _commit(s3)
        console.print(
            f"checkpoint {manifest.ref} committed in S3: {len(manifest.ranks)} ranks, "
            f"{manifest.stats.logical_bytes / 2**20:.1f} MiB of CRIU images, "
            f"{manifest.stats.stored_bytes / 2**20:.1f} MiB stored (zstd, deduplicated) "
            f"[{time.monotonic() - started:.0f} s with the boot]"
        )

        console.rule("restore: rank 0 on node-2, rank 1 on node-1")
        started = time.monotonic()
        results = _on_both_nodes(RESTORE_SCRIPT, 2, work, s3, coordinator)
        if _failed(console, results, work, "restore"):
            return False
        console.print(f"restored and finished [{time.monotonic() - started:.0f} s with the boot]")
        return _report(console, work)
    finally:
        coordinator.stop()
        plane.stop()
        stop_s3(s3)


def _commit(s3: S3Server) -> Manifest:
    secret = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    config = config_from_env(
        {},
        credentials=credentials_from_secret(secret, encoded=False, name="demo"),
        endpoint_url=s3.endpoint,
        bucket=BUCKET,
        region="us-east-1",
    )
    store = ImageStore.open(config)
    # Only a checkpoint with both nodes' parts exists for readers.
    return store.commit_parts(JOB, CHECKPOINT, ["node-1", "node-2"])


def _report(console: Console, work: Path) -> bool:
    results = {role: parse_result((work / f"{role}.out").read_text()) for _, role, _, _ in RANKS.values()}
    server, client = results["server"], results["client"]
    table = Table(title="the job after its move")
    for column in ("rank", "ran on", "restored on", "sent", "received", "bad", "checksum of what it sent"):
        table.add_column(column)
    for rank, role, before, after in RANKS.values():
        r = results[role]
        table.add_row(
            str(rank),
            f"node-{before}",
            f"node-{after}",
            *(str(r[k]) for k in ("sent", "received", "bad", "send_sum")),
        )
    console.print(table)
    exactly_once = (
        server["bad"] == 0
        and client["bad"] == 0
        and server["sent"] == client["received"]
        and client["sent"] == server["received"]
        and server["send_sum"] == client["recv_sum"]
        and client["send_sum"] == server["recv_sum"]
    )
    restored = [json.loads((work / f"restore-node-{n}.json").read_text()) for n in (1, 2)]
    slowest = max(restored, key=lambda r: sum(r["phases"].values()))
    console.print(
        "slowest node: "
        + ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in slowest["phases"].items())
        + " (CRIU restore, then verbs rebuild through the coordinator, then resume)"
    )
    if exactly_once:
        console.print("[green]every message delivered exactly once, checksums match on both sides")
    else:
        console.print("[red]exactly-once check FAILED")
    return exactly_once


def main() -> int:
    console = Console()
    console.rule("[bold]ibckpt demo: checkpoint a two-node RDMA job to S3 and restore it swapped")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ibckpt-demo-") as tmp:
        ok = run(console, Path(tmp))
    console.print(f"Total {time.monotonic() - started:.1f} s. " + ("[green]OK" if ok else "[red]FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
