"""`make demo`: bring up the local real stack and run verbs traffic across two Soft-RoCE nodes.

1. SeaweedFS S3 and a kube-apiserver (with the ibckpt CRDs) on 127.0.0.1.
2. Two qemu guests, node A and node B, joined by a private link; `ibv_rc_pingpong` runs
   between them over RoCEv2.
3. Each node stores its result in S3 through its forwarded port; the host reads them back.

It grows into the full checkpoint-and-migrate demo as those features land.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import kubernetes
import yaml
from rich.console import Console
from rich.table import Table

from testbed.guest import GUEST_HOST_ADDR, REPO, GuestSpec, run_pair
from testbed.kube import start_control_plane
from testbed.s3 import start_s3, stop_s3

BUCKET = "ibckpt-demo"
ITERS = 200

NODE_SCRIPT = """
set -e
if [ "$IBCKPT_NODE" = 1 ]; then
  ibv_rc_pingpong -d rxe0 -g 1 -n {iters} > /tmp/result 2>&1
else
  sleep 2
  ibv_rc_pingpong -d rxe0 -g 1 -n {iters} 10.77.0.1 > /tmp/result 2>&1
fi
cat /tmp/result
curl -sSf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$DEMO_S3_USER" \\
  -T /tmp/result "http://{addr}:{port}/{bucket}/pingpong-node-$IBCKPT_NODE.txt"
"""


def main() -> int:
    console = Console()
    console.rule("[bold]ibckpt demo: the local real stack")
    started = time.monotonic()
    s3 = start_s3()
    plane = start_control_plane()
    try:
        console.print(f"S3 (SeaweedFS, SigV4): {s3.endpoint}")
        console.print(f"kube-apiserver (RBAC): {plane.url}")
        api = kubernetes.config.new_client_from_config(str(plane.kubeconfig))  # type: ignore[no-untyped-call]
        ext = kubernetes.client.ApiextensionsV1Api(api)
        for crd in sorted((REPO / "crds").glob("*.yaml")):
            ext.create_custom_resource_definition(yaml.safe_load(crd.read_text()))
        names = [str(c.metadata and c.metadata.name) for c in ext.list_custom_resource_definition().items]
        console.print(f"CRDs installed: {', '.join(sorted(names))}")
        s3.client().create_bucket(Bucket=BUCKET)

        port = int(s3.endpoint.rsplit(":", 1)[1])
        script = NODE_SCRIPT.format(iters=ITERS, addr=GUEST_HOST_ADDR, port=port, bucket=BUCKET)
        env = {"DEMO_S3_USER": f"{s3.access_key}:{s3.secret_key}"}
        console.print("Booting node A and node B (qemu TCG, Soft-RoCE over a private link)...")
        node_a, node_b = run_pair(
            GuestSpec(script, forward_ports=[port], env=env),
            GuestSpec(script, forward_ports=[port], env=env),
            timeout=600,
        )
        table = Table(title="ibv_rc_pingpong across two Soft-RoCE nodes")
        for column in ("node", "exit", "boot+run s", "result (read back from S3)"):
            table.add_column(column)
        ok = True
        for result in (node_a, node_b):
            key = f"pingpong-node-{result.node}.txt"
            try:
                body = s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
                summary = next((line for line in body.splitlines() if "iters in" in line), body.strip())
            except Exception as exc:
                summary = f"missing: {exc}"
                ok = False
            ok = ok and result.returncode == 0 and f"{ITERS} iters in" in summary
            table.add_row(f"node-{result.node}", str(result.returncode), f"{result.seconds:.1f}", summary)
        console.print(table)
        if not ok:
            for result in (node_a, node_b):
                console.print(f"[red]node-{result.node} console tail:[/red]\n{result.output[-2000:]}")
        console.print(f"Total {time.monotonic() - started:.1f} s. " + ("[green]OK" if ok else "[red]FAILED"))
        return 0 if ok else 1
    finally:
        plane.stop()
        stop_s3(s3)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
