"""The forkservers among this process's children, for the forkserver tests: in pytest's process
and in the scripts they run in processes of their own (with this directory on PYTHONPATH)."""

from __future__ import annotations

import os

import psutil

TESTS = os.path.dirname(os.path.abspath(__file__))


def forkservers() -> list[int]:
    """This process's forkservers that still run (the workers forked from one have its command
    line too, but are its children; one let go of and not yet reaped has none)."""
    found = []
    for p in psutil.Process().children():
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def environ(**extra: str) -> dict[str, str]:
    """This process's environment for such a script, with ``extra``: this directory on its
    PYTHONPATH."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}
