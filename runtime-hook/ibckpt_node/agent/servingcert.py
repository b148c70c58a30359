"""The agent's serving certificate: the files of the Secret the chart mounts (made and renewed by the
operator), served as they are now. The kubelet swaps a Secret volume's files when the Secret changes,
so each new connection gets a context made from the current files, made again only when they changed;
files that stop parsing leave the last good certificate in service (and say so in the log). The volume
is optional: an agent starts (installs, prepares its node) before the operator has made the Secret,
and waits for its files, bounded, before it serves."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from pathlib import Path

from ibckpt.tls import CA_FILE, CERT_FILE, KEY_FILE, TlsSetupError, server_context

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("/etc/ibckpt/agent-tls")
DEFAULT_WAIT_S = 1200.0  # the operator's first start took 6 min on a slow emulated node
POLL_S = 2.0
Stamp = tuple[tuple[int, int, int], ...]


class ServingCertificate:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_file = directory / CERT_FILE
        self.key_file = directory / KEY_FILE
        self.ca_file = directory / CA_FILE  # the operator's CA: what the agent trusts the coordinator by
        self._context: ssl.SSLContext | None = None
        self._stamp: Stamp = ()

    def _files_stamp(self) -> Stamp:
        stamps = []
        for path in (self.cert_file, self.key_file):
            try:
                info = os.stat(path)  # follows the volume's ..data link: a swap changes the inode
            except OSError:
                return ()
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        return tuple(stamps)

    def context(self) -> ssl.SSLContext:
        """The context to serve with; TlsSetupError if no certificate was ever usable."""
        stamp = self._files_stamp()
        if self._context is not None and stamp == self._stamp:
            return self._context
        try:
            context = server_context(self.cert_file, self.key_file)
        except TlsSetupError as exc:
            if self._context is None:
                raise
            log.error("keeping the certificate served so far: %s", exc)
            return self._context
        if self._context is not None:
            log.info("serving the renewed certificate from %s", self.directory)
        self._context, self._stamp = context, stamp
        return context

    async def wait(self, timeout_s: float, poll_s: float = POLL_S) -> ssl.SSLContext:
        """The first usable context, once the kubelet has put the Secret's files in the volume (it
        syncs an optional volume about once a minute); TlsSetupError after timeout_s without one."""
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            try:
                return self.context()
            except TlsSetupError as exc:
                if time.monotonic() >= deadline:
                    waited = f"waited {timeout_s:g} s for the operator to issue it"
                    raise TlsSetupError(f"{exc} ({waited})") from exc
                if not said:
                    log.info("waiting for the operator's certificate in %s: %s", self.directory, exc)
                    said = True
            await asyncio.sleep(poll_s)
