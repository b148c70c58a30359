"""A guest reaches exactly the host loopback services it is given, and nothing else."""

from __future__ import annotations

import pytest

from testbed.guest import GUEST_HOST_ADDR, GuestSpec, run
from testbed.ports import free_port
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

GUEST_SCRIPT = """
import socket, sys, boto3
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url="http://{addr}:{port}", aws_access_key_id="{ak}",
                  aws_secret_access_key="{sk}", region_name="us-east-1",
                  config=Config(signature_version="s3v4", s3={{"addressing_style": "path"}}))
s3.put_object(Bucket="guestnet", Key="from-guest", Body=socket.gethostname().encode())
try:
    socket.create_connection(("{addr}", {closed}), timeout=3)
except OSError:
    print("unforwarded port refused")
else:
    sys.exit("reached a port that was not forwarded")
"""


def test_guest_reaches_forwarded_s3_only(s3_server: S3Server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s3_server.client().create_bucket(Bucket="guestnet")
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    script = tmp_path / "guest_s3.py"
    script.write_text(
        GUEST_SCRIPT.format(
            addr=GUEST_HOST_ADDR,
            port=port,
            ak=s3_server.access_key,
            sk=s3_server.secret_key,
            closed=free_port(),
        )
    )
    import sys

    spec = GuestSpec(f"{sys.executable} {script}", writable=[tmp_path], forward_ports=[port])
    result = run(spec, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert "unforwarded port refused" in result.output
    body = s3_server.client().get_object(Bucket="guestnet", Key="from-guest")["Body"].read()
    assert body == b"node-1"
