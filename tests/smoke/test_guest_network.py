"""A guest reaches exactly the host loopback services it is given, and nothing else."""

from __future__ import annotations

import sys

import pytest

from testbed.guest import GUEST_HOST_ADDR, GuestSpec, run
from testbed.ports import free_port
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

# The standard library only: boto3's imports take minutes in a guest under TCG on a busy machine. The
# host signs the PUT for the guest's view of the endpoint (SigV4 signs the Host header).
GUEST_SCRIPT = """
import socket, sys, urllib.request
put = urllib.request.Request({url!r}, data=socket.gethostname().encode(), method="PUT")
with urllib.request.urlopen(put, timeout=60) as answer:
    assert answer.status == 200, answer.status
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
    url = s3_server.client(endpoint=f"http://{GUEST_HOST_ADDR}:{port}").generate_presigned_url(
        "put_object", Params={"Bucket": "guestnet", "Key": "from-guest"}, ExpiresIn=3600
    )
    script.write_text(GUEST_SCRIPT.format(url=url, addr=GUEST_HOST_ADDR, closed=free_port()))
    spec = GuestSpec(f"{sys.executable} -I {script}", writable=[tmp_path], forward_ports=[port])
    result = run(spec, timeout=600)
    assert result.returncode == 0, result.output[-3000:]
    assert "unforwarded port refused" in result.output
    body = s3_server.client().get_object(Bucket="guestnet", Key="from-guest")["Body"].read()
    assert body == b"node-1"
