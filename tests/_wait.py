"""Polling helpers shared by the tests."""

from __future__ import annotations

import time

# A cell that keeps rank 1 busy for up to 120 s, in short sleeps, while the others return their
# rank at once: for a rank lost (a cut link, a cancelled job) mid-cell.
RANK_1_BUSY = (
    "%%monarch\nimport time\nt0 = time.time()\n"
    "while rank == 1 and time.time() - t0 < 120:\n    time.sleep(0.05)\nrank"
)


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
