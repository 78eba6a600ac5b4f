"""What a measurement leaves running (ipyparallel starts its controller and engines in new
sessions): a benchmark that makes itself a child subreaper has them reparented to it, and
``sweep`` finds and kills them after each measurement."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_GRACE = 5.0  # seconds a measurement's leftovers get to exit on their own before we kill them


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def sweep() -> int:
    """Kill what a finished measurement left running; returns how many processes that was."""
    import psutil

    me = psutil.Process()
    deadline = time.monotonic() + ORPHAN_GRACE
    while True:
        _reap()
        left = [p for p in me.children(recursive=True) if _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)
    _reap()
    return len(left)


def _alive(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
