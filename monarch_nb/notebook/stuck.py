"""The live panel's offer for a cell that has printed nothing for a while: a line under the
panel pointing at ``%monarch stacks``, with the collective line when the ranks' collectives
disagree ("ranks 0,2,3 wait in all_reduce #57; rank 1 is at #56, in data.py:88"), so that a
hung collective is seen without asking."""

from __future__ import annotations

import time

from monarch_nb.controller import stacks


class StuckWatch:
    """Polled by the panel's thread; asks the cell's ranks for their stacks every ``every``
    seconds once the cell has been quiet for ``quiet_after`` (each ask is answered on the
    ranks' event loops within about a second, not by their blocked threads)."""

    quiet_after = 30.0
    every = 10.0

    def __init__(self, ctl):
        self.ctl = ctl
        self._asked = 0.0
        self._note = ""

    def poll(self, request) -> None:
        if request is None or not request.remaining or self.ctl.closed:
            self._note = ""
            return
        now = time.monotonic()
        quiet = now - getattr(request, "last_event", now)
        if quiet < self.quiet_after:
            self._note = ""
            return
        if now - self._asked < self.every:
            return
        self._asked = now
        try:
            summary = stacks.ask(self.ctl, sorted(request.remaining)).summary
        except Exception:  # the cluster going down under the panel: the offer stands alone
            summary = None
        self._note = (
            f"no output for {quiet:.0f} s: %monarch stacks shows what each rank is doing"
            + (f"; {summary}" if summary else "")
        )

    def note(self, request) -> str:
        """The line for ``request`` now: empty while it prints, and once it is done."""
        return self._note if request is not None and request.remaining else ""
