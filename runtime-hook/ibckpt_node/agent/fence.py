"""The leader epoch fence: the highest operator epoch (agentapi.LEADER_EPOCH_HEADER, a pair compared in
order) this node has seen, kept on disk so a restarted agent still knows it. A call with an older epoch
comes from a deposed leader and is refused with 409 before it touches anything; so is one without an
epoch once any epoch was seen (a caller that does not elect may only drive a node no leader drives)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ibckpt.agentapi import LeaderEpoch, format_epoch, parse_epoch

log = logging.getLogger(__name__)


class Fenced(Exception):
    """The caller was deposed: 409 with this message."""


class LeaderFence:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.highest = self._load()

    def _load(self) -> LeaderEpoch | None:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return parse_epoch(text)
        except ValueError as error:
            log.warning("%s: %s: starting from none", self.path, error)
            return None

    def _store(self, epoch: LeaderEpoch) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(f"{format_epoch(epoch)}\n")
        os.replace(partial, self.path)  # a crash leaves the old epoch or the new one, never half

    def check(self, header: str | None) -> None:
        """Admit the caller, remembering a newer epoch; raise Fenced for a deposed one."""
        if header is None:
            if self.highest is not None:
                raise Fenced(
                    "the call carries no leader epoch, and operator epoch "
                    f"{format_epoch(self.highest)} leads this node"
                )
            return
        try:
            epoch = parse_epoch(header)
        except ValueError as error:
            raise Fenced(str(error)) from None
        with self._lock:
            highest = self.highest
            if highest is not None and epoch < highest:
                raise Fenced(
                    f"operator epoch {format_epoch(epoch)} was deposed: epoch {format_epoch(highest)} "
                    "leads this node now"
                )
            if highest is None or epoch > highest:
                self._store(epoch)
                if highest is not None:
                    log.info(
                        "operator epoch %s takes over from %s", format_epoch(epoch), format_epoch(highest)
                    )
                self.highest = epoch
