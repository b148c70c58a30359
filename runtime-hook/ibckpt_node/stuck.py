"""What a rank's threads are doing, for the message of a phase that timed out.

A phase that does not finish in its bound aborts the checkpoint; the abort alone says *that* a
rank hung, not *where*. The kernel knows: each thread's state, the function it sleeps in
(`wchan`) and, for root, its kernel stack. A control thread stuck in the device driver reads
differently from one that never got the CPU or one waiting on a lock in user space.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

STACK_FRAMES = 4  # the innermost frames say where; the rest is the syscall entry


@dataclass(frozen=True)
class ThreadState:
    tid: int
    name: str
    state: str  # R running, S sleeping, D uninterruptible, T stopped, ...
    wchan: str  # the kernel function the thread sleeps in; "" when running or unknown
    stack: tuple[str, ...]  # innermost kernel frames, without offsets; empty without the privilege

    def describe(self) -> str:
        # wchan reads "0" for a moment now and then; the stack's innermost frame says the same
        where = self.wchan or (self.stack[0] if self.stack else "-")
        frames = f" [{' < '.join(self.stack)}]" if self.stack else ""
        return f"{self.name}/{self.tid} {self.state} in {where}{frames}"


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def _state(stat: str) -> str:
    # "tid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")"
    _, _, rest = stat.rpartition(")")
    fields = rest.split()
    return fields[0] if fields else "?"


def _frames(stack: str) -> tuple[str, ...]:
    frames = []
    for line in stack.splitlines():
        # "[<0>] hrtimer_nanosleep+0x74/0xf0"
        symbol = line.split("] ", 1)[-1].split("+", 1)[0].strip()
        if symbol:
            frames.append(symbol)
    return tuple(frames[:STACK_FRAMES])


def thread_states(pid: int, proc: Path = Path("/proc")) -> list[ThreadState]:
    """Every thread of `pid` (empty if the process is gone)."""
    states = []
    with contextlib.suppress(OSError):
        for task in sorted((proc / str(pid) / "task").iterdir(), key=lambda p: int(p.name)):
            wchan = _read(task / "wchan").strip()
            states.append(
                ThreadState(
                    tid=int(task.name),
                    name=_read(task / "comm").strip() or "?",
                    state=_state(_read(task / "stat")),
                    wchan="" if wchan == "0" else wchan,
                    stack=_frames(_read(task / "stack")),
                )
            )
    return states


def describe_process(pid: int, prefix: str = "", proc: Path = Path("/proc")) -> str:
    """One line: each thread's name, state and where it waits (only the threads whose name
    starts with `prefix`), or that the process is gone."""
    states = thread_states(pid, proc)
    if not states:
        return f"pid {pid} is gone"
    shown = [s for s in states if s.name.startswith(prefix)]
    return f"pid {pid}: " + ("; ".join(s.describe() for s in shown) or f"no thread named {prefix}*")
