"""A rank whose worker does not answer on its event loop, where interrupt and info are answered
at once even while a cell runs: its process is stopped (SIGSTOP, a debugger, a job scheduler's
suspend), or a C call holds the GIL (a catastrophic regex), or the machine is too loaded to
run it. The controller stops waiting for such a rank after a bounded time; this module says, in
one line, what became of it and what to do."""

from __future__ import annotations

import socket

# /proc/PID/stat's state letter, in words; T and t: stopped by a signal or a tracer.
_STATES = {b"T": "stopped", b"t": "stopped", b"R": "running", b"S": "sleeping", b"D": "disk"}


def process_state(pid: int | None, host: str | None) -> str | None:
    """The state of process ``pid`` on ``host`` where that is this machine, else None (not
    here, gone, or no /proc to ask)."""
    if not pid or host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    end = stat.rfind(b")")  # the command name in parentheses may itself hold ") "
    return _STATES.get(stat[end + 2 : end + 3])


def why(pid: int | None, host: str | None) -> str:
    """One line: what keeps the rank from answering, and what to do. (``%monarch restart``
    is no remedy here: Dask's restart waits on every worker to stop, and races with the nanny
    that replaces one it had to kill.)"""
    state = process_state(pid, host)
    fresh = f"kill -KILL {pid} has its nanny start a fresh one (its namespace is lost)"
    if state == "stopped":
        return (
            f"not answering: its worker process (pid {pid}) is stopped; kill -CONT {pid} lets "
            f"it go on (the interrupt then reaches the cell), {fresh}"
        )
    if state is not None:
        return (
            f"not answering: its worker process (pid {pid}) runs but its event loop does not: "
            f"a C call holds the GIL (a long regex, say), or the machine is overloaded; {fresh}"
        )
    if pid:
        return (
            f"not answering: its worker process (pid {pid} on {host}) is stopped, or a C call "
            "holds the GIL (a long regex, say); ending that process has its nanny start a "
            "fresh one (its namespace is lost)"
        )
    return (
        "not answering: its worker process is stopped, or a C call holds the GIL (a long "
        "regex, say); ending that process has its nanny start a fresh one"
    )
