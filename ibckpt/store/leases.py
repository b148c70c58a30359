"""Leases: how writers, readers and the garbage collector's chunk sweep stay out of each other's way.

The hazard: a writer finds a chunk already in the bucket and skips it, a sweep deletes that chunk because no
committed manifest uses it yet, and the writer then commits a manifest that points at nothing.

The rule is mutual exclusion between chunk sweeps and lease holders, with both sides writing first and reading
second (S3 is strongly consistent for writes and lists, so at least one side sees the other):
- a writer or reader PUTs its lease, then lists sweeps and waits while a live one exists;
- a sweep PUTs its marker, then lists leases and gives up (deferred) while a live one exists.
Both renew their objects while working. Liveness is judged on the server's clock: an object is live if its
LastModified is within its lease of the server's Date. A holder that failed to renew for most of its lease
stops before it would commit anything, since a sweep may already have judged it dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Literal

import botocore.exceptions

from ibckpt.store.errors import LeaseError
from ibckpt.store.layout import Layout
from ibckpt.store.s3 import Connection, ListedObject, is_not_found, list_objects, s3_errors

LeaseKind = Literal["writer", "reader", "sweep"]
# A holder stops trusting its lease when it has not renewed it for this fraction of the lease time.
TRUST_FRACTION = 0.6
RENEW_FRACTION = 0.2
# S3 timestamps (LastModified, Date) may be whole seconds, both rounded down: judge liveness with this margin.
CLOCK_RESOLUTION_SECONDS = 1.0


@dataclass(frozen=True)
class LeaseRecord:
    key: str
    kind: str
    holder: str
    lease_seconds: float
    last_renewed: datetime
    job: str | None = None
    checkpoint_id: str | None = None

    def live_at(self, server_now: datetime) -> bool:
        age = (server_now - self.last_renewed).total_seconds()
        return age <= self.lease_seconds + CLOCK_RESOLUTION_SECONDS


class Lease:
    """A renewed marker object. Use as a context manager; `check()` raises once the lease can't be trusted."""

    def __init__(
        self,
        connection: Connection,
        key: str,
        kind: LeaseKind,
        lease_seconds: float,
        details: dict[str, str] | None = None,
    ) -> None:
        self._connection = connection
        self.key = key
        self.kind = kind
        self.lease_seconds = lease_seconds
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._details = details or {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_renewed = 0.0
        self._broken = False
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        body = {
            "kind": self.kind,
            "holder": self.holder,
            "lease_seconds": self.lease_seconds,
            **self._details,
        }
        return json.dumps(body).encode()

    def _put(self) -> None:
        sent = time.monotonic()
        with s3_errors(self._connection, f"renewing the {self.kind} lease {self.key}"):
            self._connection.client.put_object(
                Bucket=self._connection.config.bucket,
                Key=self.key,
                Body=self._body(),
                ContentType="application/json",
            )
        with self._lock:
            if self._last_renewed and sent - self._last_renewed > self.lease_seconds * TRUST_FRACTION:
                self._broken = True
            self._last_renewed = sent

    def acquire(self) -> Lease:
        self._put()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_seconds * RENEW_FRACTION):
            try:
                self._put()
            except Exception:
                continue

    def check(self) -> None:
        """Raise LeaseError if the lease lapsed at any point (a sweep may have run meanwhile)."""
        with self._lock:
            gap = time.monotonic() - self._last_renewed
            if self._broken or gap > self.lease_seconds * TRUST_FRACTION:
                self._broken = True
                raise LeaseError(
                    f"the {self.kind} lease {self.key} was not renewed for {gap:.0f}s "
                    f"(lease {self.lease_seconds:g}s): stopping, since garbage collection may have run"
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._connection.config.read_timeout + 5)
        # An unreleased lease expires on its own.
        with contextlib.suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            self._connection.client.delete_object(Bucket=self._connection.config.bucket, Key=self.key)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


def read_records(connection: Connection, prefix: str, action: str) -> tuple[list[LeaseRecord], datetime]:
    """The lease (or sweep) objects under prefix and the server's time when they were listed."""
    listed, server_now = list_objects(connection, prefix, action)
    return [_record(connection, item) for item in listed], server_now


def _record(connection: Connection, item: ListedObject) -> LeaseRecord:
    body: dict[str, object] = {}
    try:
        response = connection.client.get_object(
            Bucket=connection.config.bucket, Key=item.key, ChecksumMode="ENABLED"
        )
        body = json.loads(response["Body"].read())
    except botocore.exceptions.ClientError as error:
        if not is_not_found(error):
            raise
    except ValueError:
        pass  # unreadable body: judge it by its age with the default lease
    lease = body.get("lease_seconds")
    return LeaseRecord(
        key=item.key,
        kind=str(body.get("kind", "unknown")),
        holder=str(body.get("holder", "unknown")),
        lease_seconds=float(lease) if isinstance(lease, int | float) else connection.config.lease_seconds,
        last_renewed=item.last_modified,
        job=str(body["job"]) if "job" in body else None,
        checkpoint_id=str(body["checkpoint_id"]) if "checkpoint_id" in body else None,
    )


def holder_lease(
    connection: Connection, layout: Layout, kind: Literal["writer", "reader"], job: str, checkpoint_id: str
) -> Lease:
    name = f"{kind}-{job.replace('/', '.')}-{checkpoint_id}-{secrets.token_hex(4)}"
    details = {"job": job, "checkpoint_id": checkpoint_id, "started_at": datetime.now(UTC).isoformat()}
    return Lease(connection, layout.lease_key(name), kind, connection.config.lease_seconds, details)


def wait_for_sweeps(connection: Connection, layout: Layout, lease: Lease) -> None:
    """After taking `lease`: wait until no chunk sweep is live. Bounded by the longest sweep lease seen."""
    deadline: float | None = None
    while True:
        records, server_now = read_records(connection, layout.sweeps, "looking for garbage collection sweeps")
        live = [record for record in records if record.live_at(server_now)]
        if not live:
            return
        longest = max(record.lease_seconds for record in live)
        if deadline is None:
            deadline = time.monotonic() + longest * 2
        if time.monotonic() > deadline:
            raise LeaseError(
                f"a garbage collection sweep ({live[0].holder}) has held {connection.where()} "
                f"for longer than twice its lease ({longest:g}s)"
            )
        lease.check()
        time.sleep(min(1.0, longest / 4))
