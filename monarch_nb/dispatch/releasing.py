"""A cell's first failure releases the ranks still running it.

Ranks of one cell run one program over one process group: when one raises (or its worker dies)
the others are, or soon will be, waiting for it in a collective, until the group's timeout. So
the first failure stops them, as torchrun stops a job's other workers and Monarch's supervision
a mesh:

1. ``RELEASE_GRACE`` after it, a rank still running gets an interrupt that says why
   (``release``): one in Python code stops there and reports ``Released: rank 2 failed`` with
   where it was. The grace lets ranks that fail of themselves at about the same time (the same
   bad argument on every rank, a checkpoint's error every rank agrees on) say their own error;
2. ``RELEASE_GRACE`` later, a rank still running is waiting in C: every live rank of the cell
   then cuts its process groups' connections (rank/release.py), which ends every collective
   waiting on them within milliseconds, or, for ``%monarch run``, ends its scripts (their
   collectives are in their own processes). The group is formed again before the next cell
   (controller/dist.py).

It runs on whichever thread reads the failure (the notebook's, or the Reader's for a
``--noblock`` cell), and the second step on a timer's: interrupts are sent from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch_nb.errors import ClusterError

if TYPE_CHECKING:
    from monarch_nb.dispatch.links import Request
    from monarch_nb.dispatch.protocol import Ctl

# Each step's wait: ranks failing of themselves report within it, and a rank in Python code
# stops at the interrupt within milliseconds, so one still running after it is waiting in C,
# most likely in a collective with the rank that failed. Two make the release's 0.5 s.
RELEASE_GRACE = 0.25


class Release:
    """``Request.on_failure`` of a cell on several ranks: called with the rank and its event
    when one fails. ``cut``: what the second step ends on every rank ("group" or
    "children"); ``interrupt``: dispatch.py's ``send_interrupt``. Keeps ``first``, the rank
    whose failure came first, and ``cut_at``."""

    def __init__(self, ctl: Ctl, req: Request, cut: str, interrupt: Callable[..., Any]):
        self.ctl, self.req, self.what, self._send_interrupt = ctl, req, cut, interrupt
        self.first: int | None = None
        self.reason: str | None = None
        self.cut_at: float | None = None  # time.monotonic() of the second step, if it came
        self._lock = threading.Lock()

    def __call__(self, rank: int, ev: dict[str, Any]) -> None:
        with self._lock:
            if self.first is not None:
                return
            self.first = rank
        self.reason = f"rank {rank} failed"
        _later(self._stop)

    def because(self, reason: str) -> None:
        """Release every rank still running for ``reason``, a failure of none of them (the
        cluster's torchft Lighthouse exited), at once and then cutting as above."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        self._stop()

    def _stop(self) -> None:
        running = self._running()
        if running and self._send(running):
            _later(self._cut)

    def _cut(self) -> None:
        if not self._running():
            return
        self.cut_at = time.monotonic()
        lost = {r for r, status in self.req.status.items() if status == "lost"}
        self._send([r for r in self.req.ranks if r not in lost], cut=self.what)

    def _running(self) -> list[int]:
        remaining = self.req.remaining
        return [r for r in self.req.ranks if r in remaining]

    def _send(self, ranks: list[int], cut: str | None = None) -> bool:
        try:
            self._send_interrupt(self.ctl, ranks, self.req.id, release=self.reason, cut=cut)
        except ClusterError:  # the cluster went down meanwhile: nothing left to release
            return False
        return True


def _later(step) -> None:
    timer = threading.Timer(RELEASE_GRACE, step)
    timer.daemon = True
    timer.start()
