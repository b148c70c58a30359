"""Wrong credentials, a missing bucket, an unreachable or silent endpoint: clear messages, no secrets."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from ibckpt.store import (
    BucketNotFoundError,
    Credentials,
    CredentialsError,
    EndpointUnreachableError,
)
from ibckpt.store.errors import AccessDeniedError
from testbed.s3 import S3Server

pytestmark = pytest.mark.s3

WRONG_SECRET = "wrong-secret-Zq8w1xYv7Lk2Pq9r"


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """Accepts TCP connections and never answers: a hung server."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_wrong_secret_key(make_store: Any) -> None:
    bad = Credentials(
        access_key_id=SecretStr("ibckpt-unknown"),
        secret_access_key=SecretStr(WRONG_SECRET),
        source="Secret s3-creds",
    )
    with pytest.raises((CredentialsError, AccessDeniedError)) as info:
        make_store(credentials=bad)
    message = str(info.value)
    assert "Secret s3-creds" in message and "127.0.0.1" in message and "bucket" in message
    assert WRONG_SECRET not in message


def test_right_key_wrong_secret(make_store: Any, s3_server: S3Server) -> None:
    bad = Credentials(
        access_key_id=SecretStr(s3_server.access_key), secret_access_key=SecretStr(WRONG_SECRET), source="env"
    )
    with pytest.raises(CredentialsError) as info:
        make_store(credentials=bad)
    assert "rejected the credentials" in str(info.value)
    assert WRONG_SECRET not in str(info.value) and s3_server.secret_key not in str(info.value)


def test_missing_bucket(make_store: Any, s3_server: S3Server) -> None:
    with pytest.raises(BucketNotFoundError) as info:
        make_store(bucket="no-such-bucket-here")
    assert (
        str(info.value) == f"bucket 'no-such-bucket-here' does not exist (endpoint {s3_server.endpoint}, "
        "bucket 'no-such-bucket-here')"
    )


def test_unreachable_endpoint(make_store: Any, closed_port: int) -> None:
    endpoint = f"http://127.0.0.1:{closed_port}"
    with pytest.raises(EndpointUnreachableError) as info:
        make_store(endpoint_url=endpoint, max_attempts=2)
    message = str(info.value)
    assert message.startswith("cannot reach the S3 endpoint while checking the bucket")
    assert endpoint in message and "2 attempts" in message


def test_silent_endpoint_times_out(make_store: Any, silent_endpoint: str) -> None:
    with pytest.raises(EndpointUnreachableError) as info:
        make_store(endpoint_url=silent_endpoint, max_attempts=1, read_timeout=1.0, connect_timeout=1.0)
    assert "timed out" in str(info.value) and silent_endpoint in str(info.value)


def test_cli_prints_the_message_and_not_the_secret(
    s3_env: dict[str, str], closed_port: int, ibckpt: Any
) -> None:
    # A real process: the message, and nothing else (no traceback, no secret) on stderr.
    result = ibckpt(dict(s3_env, AWS_SECRET_ACCESS_KEY=WRONG_SECRET), "ls", check=False, in_process=False)
    assert result.returncode == 1
    assert result.stderr.startswith(
        "ibckpt: error: the server rejected the credentials from the AWS credential"
    )
    assert "AWS credential chain (env)" in result.stderr and len(result.stderr.splitlines()) == 1
    assert WRONG_SECRET not in result.stdout + result.stderr

    result = ibckpt(dict(s3_env, IBCKPT_S3_BUCKET="absent-bucket"), "ls", check=False)
    assert result.returncode == 1 and "bucket 'absent-bucket' does not exist" in result.stderr

    env = dict(s3_env, IBCKPT_S3_ENDPOINT=f"http://127.0.0.1:{closed_port}", IBCKPT_S3_MAX_ATTEMPTS="1")
    result = ibckpt(env, "ls", check=False)
    assert result.returncode == 1 and "cannot reach the S3 endpoint" in result.stderr

    result = ibckpt(dict(s3_env, IBCKPT_S3_BUCKET=""), "ls", check=False)
    assert (
        result.returncode == 2
        and "bucket: Value error, required (--bucket or IBCKPT_S3_BUCKET)" in result.stderr
    )


def test_clients_share_one_session_but_never_each_others_keys(make_store: Any, s3_server: S3Server) -> None:
    """Stores given credentials share one boto3 session (its models load once: 13 s per client on the
    testbed's emulated nodes otherwise); each client signs with its own keys, in either order."""
    bad = Credentials(
        access_key_id=SecretStr(s3_server.access_key), secret_access_key=SecretStr(WRONG_SECRET), source="env"
    )
    good = make_store()
    with pytest.raises(CredentialsError):
        make_store(credentials=bad)
    make_store()  # the refused keys did not stick to the session
    assert good.checkpoints() == []
