"""Polling helpers shared by the tests."""

from __future__ import annotations

import os
import signal
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


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped. The kernel stops the
    others only when the one it told has run, so on a loaded machine a thread woken meanwhile
    (by a request on its socket) still runs code after ``kill`` has returned."""
    os.kill(pid, signal.SIGSTOP)
    if not wait_for(lambda: all(state in "tT" for state in _thread_states(pid)), 30, 0.005):
        os.kill(pid, signal.SIGCONT)  # as it was: the caller's clean-up is not reached
        raise AssertionError(f"process {pid} did not stop within 30 s of SIGSTOP")


def _thread_states(pid: int) -> list[str]:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # the thread ended
            pass
    return states
