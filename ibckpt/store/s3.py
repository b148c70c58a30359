"""The S3 client as the store uses it: built from StoreConfig, every call bounded by timeouts and retries,
and every botocore failure turned into a StoreError that names the endpoint and bucket (not the secret)."""

from __future__ import annotations

import email.utils
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

# boto3 and botocore's Config are imported where a client is made: with them, importing the store
# took 0.4 s more CPU (twice the operator's handlers), minutes on the testbed's emulated nodes before
# the operator answered its probes. botocore.exceptions alone is cheap.
import botocore.exceptions

from ibckpt.store.config import StoreConfig
from ibckpt.store.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CredentialsError,
    EndpointUnreachableError,
    StoreError,
)

if TYPE_CHECKING:
    import boto3
    from botocore.config import Config as BotoConfig
    from types_boto3_s3.client import S3Client
else:
    S3Client = Any

_REJECTED_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
_WRONG_REGION = {
    "PermanentRedirect",
    "301",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
}
_UNREACHABLE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ProxyConnectionError,
)


@dataclass(frozen=True)
class Connection:
    """A client and what the messages may say about it."""

    client: S3Client
    config: StoreConfig
    credential_source: str

    def where(self) -> str:
        return self.config.where()


# One boto3 session for every client given explicit credentials (the operator's and the agents': from
# Secrets). A session loads botocore's endpoint and service models once; a new session per client loaded
# them again each time, which took 13 s per storage check on the testbed's emulated nodes. Credentials go
# to each client, never into the shared session. Creating clients from one session is not thread-safe.
_SHARED_LOCK = threading.Lock()
_shared: boto3.session.Session | None = None


def _shared_session() -> boto3.session.Session:
    """The shared session, made on first use; call with _SHARED_LOCK held."""
    global _shared
    if _shared is None:
        import boto3

        _shared = boto3.session.Session()
    return _shared


def _client_with(config: StoreConfig, boto_config: BotoConfig, verify: str | bool) -> S3Client:
    creds = config.credentials
    assert creds is not None
    with _SHARED_LOCK:
        return _shared_session().client(
            "s3",
            region_name=config.region,
            endpoint_url=config.endpoint_url,
            config=boto_config,
            verify=verify,
            aws_access_key_id=creds.access_key_id.get_secret_value(),
            aws_secret_access_key=creds.secret_access_key.get_secret_value(),
            aws_session_token=creds.session_token.get_secret_value() if creds.session_token else None,
        )


def warm() -> None:
    """Load botocore's models into the shared session now, with a client that is never used: call it in a
    background thread when a component starts. Otherwise the first storage check or upload loads them, and
    on the testbed's emulated nodes that took 30 to 56 s of a first CheckpointJob after each operator
    start. No request is made; the placeholder credentials reach nothing."""
    from botocore.config import Config as BotoConfig

    with _SHARED_LOCK:
        _shared_session().client(
            "s3",
            region_name="us-east-1",
            endpoint_url="http://127.0.0.1:9",
            config=BotoConfig(signature_version="s3v4"),
            aws_access_key_id="unused",
            aws_secret_access_key="unused",
        )


def connect(config: StoreConfig) -> Connection:
    """A client for the configured endpoint. Raises CredentialsError if the AWS chain finds nothing."""
    import boto3
    from botocore.config import Config as BotoConfig

    creds = config.credentials
    session = None
    if creds is not None:
        source = creds.source
    else:  # the AWS chain (environment, profile...) as it is now: a session of its own
        session = boto3.session.Session(region_name=config.region)
        resolved = session.get_credentials()
        if resolved is None:
            raise CredentialsError(
                f"no S3 credentials for {config.where()}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "a profile, or IBCKPT_S3_CREDENTIALS_DIR (a mounted Secret)"
            )
        source = f"the AWS credential chain ({resolved.method})"
    boto_config = BotoConfig(
        signature_version="s3v4",
        # No SHA-256 of each body for SigV4 (botocore skips it on https already, and signs it on http): a
        # chunk's id is its own SHA-256, checked on every restore, and the manifests that name them are
        # signed. That pass cost as much as the chunk id's on the testbed's emulated CPUs.
        s3={"addressing_style": config.addressing_style, "payload_signing_enabled": False},
        retries={"max_attempts": config.max_attempts, "mode": config.retry_mode},
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        max_pool_connections=config.workers + 4,
        tcp_keepalive=True,
        user_agent_extra="ibckpt",
        # Requests keep botocore's CRC32 (the default): SeaweedFS checks it and not the SigV4 payload hash
        # (a body changed after signing is refused only with it), so it is the upload's integrity check.
        # Responses are checked only where a GET asks (ChecksumMode="ENABLED": manifests, parts, leases,
        # which no chunk id covers): every chunk is hashed against its id on the way in, and a CRC32 of it
        # too was one more pass over every byte restored.
        response_checksum_validation="when_required",
    )
    verify: str | bool = config.ca_bundle if config.ca_bundle else config.verify_tls
    try:
        if session is None:
            client = _client_with(config, boto_config, verify)
        else:
            client = session.client("s3", endpoint_url=config.endpoint_url, config=boto_config, verify=verify)
    except ValueError as error:  # e.g. a malformed endpoint URL
        raise StoreError(f"cannot use S3 endpoint {config.endpoint_url!r}: {error}") from None
    return Connection(client, config, source)


def error_code(error: botocore.exceptions.ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def is_not_found(error: botocore.exceptions.ClientError) -> bool:
    return error_code(error) in {"404", "NoSuchKey", "NotFound"}


@contextmanager
def missing_as(error: Callable[[], StoreError]) -> Iterator[None]:
    """Raise `error()` in place of S3's not-found answer (404, NoSuchKey); other errors pass on."""
    try:
        yield
    except botocore.exceptions.ClientError as found:
        if is_not_found(found):
            raise error() from None
        raise


def translate(error: Exception, connection: Connection, action: str) -> StoreError:
    """A StoreError for a botocore failure during `action` (e.g. "listing checkpoints")."""
    where = connection.where()
    if isinstance(error, StoreError):
        return error
    if isinstance(error, botocore.exceptions.ClientError):
        code = error_code(error)
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {connection.config.bucket!r} does not exist ({where}) while {action}"
            )
        if code in _WRONG_REGION:
            headers = error.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            actual = headers.get("x-amz-bucket-region")
            hint = f"it is in {actual}" if actual else "check the region"
            return StoreError(
                f"bucket {connection.config.bucket!r} is not in region "
                f"{connection.config.region or '(default)'} "
                f"({where}) while {action}: {hint} (--region / IBCKPT_S3_REGION)"
            )
        if code in _REJECTED_CREDENTIALS:
            return CredentialsError(
                f"the server rejected the credentials from {connection.credential_source} ({code}) "
                f"while {action} ({where})"
            )
        if code in {"AccessDenied", "Forbidden", "403"} or status == 403:
            return AccessDeniedError(
                f"access denied while {action} ({where}): the credentials from "
                f"{connection.credential_source} are wrong or not allowed to do this"
            )
        message = error.response.get("Error", {}).get("Message", "")
        return StoreError(f"S3 error {code or status} while {action} ({where}): {message}".rstrip(": "))
    if isinstance(error, botocore.exceptions.SSLError):
        return EndpointUnreachableError(
            f"TLS failed while {action} ({where}): {_first_line(error)}; "
            "give the server's CA with --ca-bundle / IBCKPT_S3_CA_BUNDLE"
        )
    if isinstance(error, botocore.exceptions.ReadTimeoutError | botocore.exceptions.ConnectTimeoutError):
        config = connection.config
        return EndpointUnreachableError(
            f"S3 endpoint timed out while {action} ({where}; connect timeout {config.connect_timeout:g}s, "
            f"read timeout {config.read_timeout:g}s, {config.max_attempts} attempts)"
        )
    if isinstance(error, _UNREACHABLE):
        return EndpointUnreachableError(
            f"cannot reach the S3 endpoint while {action} ({where}, "
            f"{connection.config.max_attempts} attempts): {_first_line(error)}"
        )
    if isinstance(
        error, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError
    ):
        return CredentialsError(f"incomplete S3 credentials from {connection.credential_source} ({where})")
    if isinstance(error, botocore.exceptions.BotoCoreError):
        return StoreError(f"S3 client error while {action} ({where}): {_first_line(error)}")
    return StoreError(f"unexpected error while {action} ({where}): {type(error).__name__}: {error}")


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


@contextmanager
def s3_errors(connection: Connection, action: str) -> Iterator[None]:
    """Turn botocore failures inside the block into StoreErrors."""
    try:
        yield
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        raise translate(error, connection, action) from error


def server_time(response: Any) -> datetime:
    """The server's clock, from a response's Date header (leases are judged on one clock: the server's)."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    date = headers.get("date")
    if date:
        return email.utils.parsedate_to_datetime(date).astimezone(UTC)
    return datetime.now(UTC)


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    last_modified: datetime


def list_objects(connection: Connection, prefix: str, action: str) -> tuple[list[ListedObject], datetime]:
    """Every object under prefix, and the server time of the first page."""
    found: list[ListedObject] = []
    now: datetime | None = None
    with s3_errors(connection, action):
        for page in pages(connection.client.list_objects_v2, Bucket=connection.config.bucket, Prefix=prefix):
            if now is None:
                now = server_time(page)
            for item in page.get("Contents", []):
                found.append(ListedObject(item["Key"], item["Size"], item["LastModified"].astimezone(UTC)))
    return found, now or datetime.now(UTC)


# A listing's next page: each request field, and the response field that gives it.
_NEXT_PAGE = {
    "ContinuationToken": "NextContinuationToken",
    "KeyMarker": "NextKeyMarker",
    "UploadIdMarker": "NextUploadIdMarker",
}


def pages(operation: Callable[..., Any], **request: Any) -> Iterator[dict[str, Any]]:
    """Every page of a listing, without botocore's paginators: the first get_paginator of a session loads
    the paginator models through a scan of every service botocore knows (stat and listdir of each data
    directory), which took 24 s of CPU at a guest's first upload on the testbed (9p)."""
    while True:
        page = operation(**request)
        yield page
        if not page.get("IsTruncated"):
            return
        following = {field: page[answer] for field, answer in _NEXT_PAGE.items() if page.get(answer)}
        if not following:
            return  # truncated with no way on: a server's bug, not an endless loop
        request.update(following)


def check_bucket(connection: Connection) -> None:
    """Fail early, with a clear message, if the bucket is absent or the credentials are refused."""
    try:
        connection.client.head_bucket(Bucket=connection.config.bucket)
    except botocore.exceptions.ClientError as error:
        if error_code(error) in {"404", "NoSuchBucket", "NotFound"}:
            raise BucketNotFoundError(
                f"bucket {connection.config.bucket!r} does not exist ({connection.where()})"
            ) from error
        # HEAD responses have no body, so a 403 here cannot say which: ask again with a GET that can.
        if error_code(error) in {"403", "Forbidden"}:
            with s3_errors(connection, "checking the bucket"):
                connection.client.list_objects_v2(Bucket=connection.config.bucket, MaxKeys=1)
        raise translate(error, connection, "checking the bucket") from error
    except botocore.exceptions.BotoCoreError as error:
        raise translate(error, connection, "checking the bucket") from error
