"""What a worker waits for before it leaves the cluster (``%monarch scale`` down): the work the
folders above rank/ run on it, each of which puts its wait here as its worker side starts
(actors/worker.py: the actors' running calls)."""

from __future__ import annotations

from collections.abc import Callable

# Each is called with ``told``, which it calls once with the name of what keeps it waiting past
# a second (or None: nothing to tell).
waits: list[Callable[[Callable[[str], None] | None], None]] = []


def wait_for_work(told: Callable[[str], None] | None = None) -> None:
    """Return once every wait put here has ended."""
    for wait in list(waits):
        wait(told)
