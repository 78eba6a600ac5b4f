"""Polling helpers shared by the tests."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 60, interval: float = 0.2) -> bool:
    """True as soon as ``predicate()`` is true; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def running(pids) -> list[int]:
    """The pids that are still processes (a zombie has exited: it only waits to be reaped)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
