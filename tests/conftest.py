"""Session fixtures for the real parts: S3 (SeaweedFS), kube-apiserver, Soft-RoCE guests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.s3 import S3Server, start_s3, stop_s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real SeaweedFS S3 gateway on 127.0.0.1 that enforces SigV4."""
    server = start_s3(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        stop_s3(server)
