"""Polling helper shared by the tests."""

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
