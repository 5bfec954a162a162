"""Signal policy of redraft's child processes (the engine, tensor-parallel ranks, helper pools); torch-free.

A supervisor stopping the server signals the whole process group (systemd's `KillMode=control-group`,
`timeout`, `kill -- -PGID`, Ctrl-C in a terminal). Only the HTTP process may act on that signal: it drains the
running requests, then stops its children itself. So a child ignores SIGINT and SIGTERM from its first
instruction on, and ends by itself when its parent is gone (a SIGKILL or a crash of the parent), so that no
process of redraft ever outlives the server:

- the parent starts a child inside `group_signals_blocked()`: the child inherits a signal mask with SIGINT and
  SIGTERM blocked, so a signal that arrives while it is still importing stays pending instead of killing it;
- the child calls `shield_from_group_signals()` first thing: both signals are ignored (the pending ones are
  dropped), and on Linux the kernel kills it when its parent dies (PR_SET_PDEATHSIG).

A pool of helper processes does the same with `initializer=shield_from_group_signals, initargs=(False,)` (False:
a pool may start its workers from any thread, and the kernel's death signal follows the starting thread); its
owner shuts it down, and `end_children` at the server's exit ends whatever is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Iterator

log = logging.getLogger("redraft.child_process")

GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def group_signals_blocked() -> Iterator[None]:
    """Block SIGINT/SIGTERM in this thread while a child process starts (fork and exec keep the mask). The
    parent loses nothing: a signal for the process is delivered to another thread meanwhile, or when the mask
    is restored."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it exits (Linux only). Valid because
    redraft starts its engine and ranks from the main thread of their parent, which lives as long as it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_pid() -> int:
    """The pid of the process that started this one: multiprocessing's record, which stays right even when the
    parent died before this line (os.getppid() would then name the reaper)."""
    parent = mp.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def parent_alive(pid: int) -> bool:
    """Whether the parent `pid` still runs. Exact for a direct child (started with the spawn or fork method, not
    forkserver): a dead parent's children are handed to a reaper at once, so getppid() changes."""
    return os.getppid() == pid


def shield_from_group_signals(die_with_parent: bool = True) -> int:
    """In a child, first thing: ignore SIGINT/SIGTERM (the parent shuts us down), die with the parent when
    asked (only for a child started from the parent's main thread), and exit at once if the parent is already
    gone (a direct child: see parent_alive). Returns the parent's pid, for the child's own periodic check where the kernel gives no death signal."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)  # pending ones are dropped: they are ignored now
    pid = parent_pid()
    if die_with_parent:
        _die_with_parent()
    if not parent_alive(pid):  # it died before the death signal was armed
        log.warning("parent process %d is gone: exiting", pid)
        os._exit(0)
    return pid


def end_children(grace_s: float) -> list[str]:
    """End every child process this one started through multiprocessing (any context: the engine, ranks, pool
    workers): wait up to `grace_s` for those already asked to stop, then SIGKILL the rest (they ignore SIGTERM).
    Called on the way out, so that multiprocessing's exit hook, which SIGTERMs and then joins its daemonic
    children, never waits on one that ignores SIGTERM. Returns the names of the children it had to kill."""
    deadline = time.monotonic() + grace_s
    killed = []
    for child in mp.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            killed.append(child.name)
            child.kill()
            child.join(5)
    return killed
