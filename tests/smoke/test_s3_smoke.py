"""The real S3 server: multipart round trip with sha256, and SigV4 enforced."""

from __future__ import annotations

import hashlib
import os

import botocore.exceptions
import pytest
from boto3.s3.transfer import TransferConfig

from testbed.s3 import S3Server

pytestmark = pytest.mark.s3


def test_multipart_round_trip_sha256(s3_server: S3Server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s3 = s3_server.client()
    s3.create_bucket(Bucket="smoke-multipart")
    src = tmp_path / "blob"
    data = os.urandom(13 * 1024 * 1024 + 17)  # not a multiple of the part size
    src.write_bytes(data)
    cfg = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    s3.upload_file(str(src), "smoke-multipart", "blob", Config=cfg)
    head = s3.head_object(Bucket="smoke-multipart", Key="blob")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-3"), "expected a 3-part multipart object"
    dst = tmp_path / "back"
    s3.download_file("smoke-multipart", "blob", str(dst), Config=cfg)
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


def test_wrong_credentials_are_rejected(s3_server: S3Server) -> None:
    bad_secret = s3_server.client(secret_key="not-the-secret-key-at-all")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        bad_secret.list_buckets()
    assert info.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "AccessDenied"}
    unknown_key = s3_server.client(access_key="AKIAUNKNOWN0000000000")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        unknown_key.list_buckets()
    assert info.value.response["Error"]["Code"] in {"InvalidAccessKeyId", "AccessDenied"}
