"""``CellHandle``: a cell started with ``--noblock`` (``block=False``)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from monarch_nb.dispatch import dispatch
from monarch_nb.dispatch.links import Request
from monarch_nb.dispatch.output import ConsoleSink, Renderer
from monarch_nb.dispatch.results import Interrupted, ValueMesh
from monarch_nb.dispatch.targets import format_ranks

if TYPE_CHECKING:
    from monarch_nb.dispatch.protocol import Ctl


class CellHandle:
    """A cell started with ``block=False`` (``--noblock``): output keeps arriving while the
    notebook stays usable."""

    def __init__(self, ctl: Ctl, req: Request, renderer: Renderer, timeout: float | None):
        self._ctl, self._req = ctl, req
        self._done = threading.Event()
        # interrupt() sets it: the follower stops waiting for ranks that cannot answer (a
        # stopped process) after the grace an interrupt gives, as Ctrl-C does for a cell.
        self._stop = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._sink = renderer.sink
        self._thread = threading.Thread(
            target=self._follow, args=(renderer, timeout), daemon=True, name=f"monarch-{req.id}"
        )
        self._thread.start()

    def _follow(self, renderer: Renderer, timeout: float | None) -> None:
        try:
            outcomes, stopped = dispatch.collect(
                self._ctl, self._req, renderer, timeout, self._stop
            )
            self._value = dispatch.settle(self._ctl, self._req, outcomes, stopped, timeout)
        except BaseException as e:
            self._error = e
        finally:
            finish = getattr(self._sink, "finish", None)
            if finish is not None:  # the cell's display says how it ended
                with contextlib.suppress(Exception):
                    finish(self._ending())
            self._done.set()

    def _ending(self) -> str:
        ranks = format_ranks(self._req.ranks)
        if self._error is None:
            return f"[{ranks}] done"
        headline = getattr(self._error, "headline", None) or type(self._error).__name__
        return f"[{ranks}] {headline}: handle.result() raises it"

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> ValueMesh:
        try:
            done = self._done.wait(timeout)
        except KeyboardInterrupt:
            raise Interrupted(
                f"stopped waiting for the cell; it goes on running on "
                f"{format_ranks(self._req.ranks)} (handle.interrupt() stops it)"
            ) from None
        if not done:
            raise TimeoutError(f"the cell is still running on {format_ranks(self._req.ranks)}")
        if self._error is not None:
            raise self._error
        return self._value

    def interrupt(self) -> None:
        # ranks waiting in a collective their peers will not call are set free too, as a
        # blocking cell's are (controller/dist.py); the next cell forms the group again
        cut = self._ctl._interrupt_cut(self._req)
        dispatch.send_interrupt(self._ctl, self._req.ranks, self._req.id, cut=cut)
        self._stop.set()

    @property
    def output(self) -> list[str]:
        """The lines the cell printed so far, tagged by rank (in a Jupyter kernel): every one,
        or the last 64 MiB of them behind a line that says how many came before."""
        output = getattr(self._sink, "output", None)
        return output() if output is not None else []

    def display_outputs(self) -> None:
        """Show the rich outputs (figures, HTML) the cell produced, tagged by rank."""
        for ranks, data, metadata, display_id in getattr(self._sink, "rich", []):
            # with its display id: a rank's widget shown here is kept when the cluster goes down
            ConsoleSink().display(ranks, data, metadata, display_id)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        parked = sorted(self._req.turns.parked) if self._req.turns and not self.done() else []
        if parked:
            state += f"; {format_ranks(parked)} waiting in the debugger (%monarch debug --rank R)"
        return f"<CellHandle {self._req.id} on {format_ranks(self._req.ranks)}: {state}>"
