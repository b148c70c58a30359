"""Nothing the testbed starts outlives the test session, even when pytest is killed."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGKILL to this child when the process that spawned it dies.

    Children run in sessions of their own (so a test's Ctrl-C does not reach them); without
    this, a pytest killed with SIGKILL left its qemu guests, etcd and apiserver running.
    """
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
