"""The live notebook panel: per rank its device, state, utilization and memory (bars, and lines
for the last minute) and the loss against the step, as one SVG drawn by ``panel_svg``.

The SVG is the value of one ``ipywidgets.HTML``, replaced in place at most ``hz`` times a
second, at a size that depends only on the number of ranks (no layout jumps); the page needs no
JavaScript library. The panel is displayed with a display id and a ``text/html`` copy of the
picture beside the widget, for front ends without a widget manager. When its cell ends it
freezes: the output becomes the static picture alone (what a saved notebook shows when
reopened) and the widget is closed. On a cluster started with ``--ft``, a cell's panel also
sends its fault-tolerance feed (telemetry/ft_feed.py) to the scheduler as it changes, for the
sidebar.
"""

from __future__ import annotations

import collections
import threading
import time

from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.notebook import panel_ft, panel_svg
from monarch_nb.notebook.stuck import StuckWatch
from monarch_nb.telemetry import ft_feed, metrics

DEFAULT_HZ = 2.0
SHOW_AFTER = 1.0  # seconds a blocking cell runs before its panel appears
LOSS_POINTS = panel_svg.MAX_POINTS  # points per rank in the loss chart (evenly thinned)
HISTORY_SAMPLES = 600  # newest samples read per rank: a minute at up to 10 Hz
KEEP_PANELS = 8  # panels kept live; past that, the oldest finished one is frozen
NO_WIDGETS = "a static picture: widgets need a Jupyter kernel (pip install ipywidgets)"
NO_WIDGET_MANAGER = "a static picture: the live panel needs a front end that shows ipywidgets"


def widgets_available() -> bool:
    """ipywidgets imports, and a Jupyter kernel will send the widget to a front end."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _header(ctl) -> str:
    state = "down" if ctl.closed else f"{ctl.world_size} ranks"
    return f"{state} at {ctl.scheduler_address}"


def static_bundle(ctl, title: str, why: str) -> dict[str, str]:
    """The panel's picture now, as a display bundle, with ``why`` it is not live."""
    snapshot = ctl.metrics.snapshot(points=LOSS_POINTS, samples=HISTORY_SAMPLES)
    ranks = [i.rank for i in ctl.ranks]
    ft = panel_ft.feed(ctl, None, time.time())
    view = panel_svg.panel_view(snapshot, ranks=ranks, ft=ft)
    return {
        "text/html": panel_svg.render(view, title, _header(ctl), note=why),
        "text/plain": f"{metrics.format_latest()}\n{title}: {why}",
    }


class LivePanel:
    """A live view of one cluster; ``track(request)`` adds the state of a running cell."""

    def __init__(self, ctl, hz: float = DEFAULT_HZ, title: str = "monarch-nb"):
        from ipywidgets import HTML

        self.ctl = ctl
        self.interval = 1.0 / hz
        self.title = title
        self.request = None
        self.handle = None  # the display handle, once shown
        self.updates = 0  # how many times fresh metrics were read (tests read it)
        self.view: dict | None = None
        self.ft: dict | None = None  # on a cluster started with --ft, its feed (ft_feed.py)
        self.widget = HTML()
        self._snapshot: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics_news = False
        self._unsubscribe = ctl.metrics.subscribe(self._on_metrics)
        self._released = False
        self._freeze_lock = threading.Lock()
        self.stuck = StuckWatch(ctl)  # offers %monarch stacks under a quiet cell
        self.frozen: str | None = None  # the final picture, once frozen
        self.refresh()

    def _on_metrics(self, _event) -> None:
        self._metrics_news = True

    # -- what the panel shows --------------------------------------------------------------
    def track(self, request) -> None:
        """Show the state of ``request`` (a cell) on each of its ranks until it finishes, and
        what the cell logs (not what earlier cells did); the picture says so from now, not
        from the updating thread's next turn."""
        self.request = request
        self.refresh()

    def cell_states(self) -> dict[int, tuple[str, float | None]]:
        """rank -> (state, seconds since the cell started); without a cell: up, lost or down.
        A fault-tolerant cell's rank on its way back: lost, joining, healing (panel_ft.py)."""
        dead = {i.rank for i in self.ctl.ranks if not i.alive}
        req = self.request
        if req is None:
            if self.ctl.closed:
                return {i.rank: ("down", None) for i in self.ctl.ranks}
            return {i.rank: ("lost" if i.rank in dead else "up", None) for i in self.ctl.ranks}
        now = time.time()
        states = {}
        away = panel_ft.away(self.ctl, req)
        for rank in req.ranks:
            status = req.status.get(rank)
            if status is None and rank in req.remaining and rank in away:
                states[rank] = (away[rank], None)
            elif status is None and rank in req.remaining:
                states[rank] = ("lost", None) if rank in dead else ("running", now - req.t0)
            else:
                states[rank] = ({"ok": "done"}.get(status, status or "done"), None)
        return states

    def refresh(self, force: bool = True) -> None:
        """Re-read the metrics (the updating thread: only when there are new ones) and redraw
        the picture; the widget's value is sent only when it changed."""
        req = self.request
        if force or self._metrics_news or self._snapshot is None:
            self._metrics_news = False
            self._snapshot = self.ctl.metrics.snapshot(
                points=LOSS_POINTS,
                samples=HISTORY_SAMPLES,
                rows_since=req.t0 if req is not None else None,  # the cell's own rows
            )
            self.updates += 1
        ranks = req.ranks if req is not None else [i.rank for i in self.ctl.ranks]
        now = time.time()
        self.ft = panel_ft.feed(self.ctl, req, now)
        self.view = panel_svg.panel_view(
            self._snapshot,
            self.cell_states(),
            ranks=ranks,
            now=now,
            cell=req is not None,
            ft=self.ft,
        )
        value = self.html()
        if value != self.widget.value:
            self.widget.value = value

    def publish(self) -> None:
        """A cell's panel tells the scheduler (so the sidebar) its fault-tolerance feed:
        only when it changed, never waiting (ft_feed.publish)."""
        if self.ft is not None and self.request is not None and not self.ctl.closed:
            ft_feed.publish(self.ctl.client, self.ft)

    def html(self, note: str = "") -> str:
        note = note or self.stuck.note(self.request)
        return panel_svg.render(self.view, self.title, _header(self.ctl), note=note)

    def text(self) -> str:
        return panel_svg.text(self.view, self.title, self.stuck.note(self.request))

    # -- running -----------------------------------------------------------------------------
    def show(self):
        """Display the panel: the widget, and the picture for front ends without widgets."""
        from IPython.display import display

        bundle = self.widget._repr_mimebundle_()
        bundle["text/html"] = self.html(note=NO_WIDGET_MANAGER)
        bundle["text/plain"] = self.text()
        self.handle = display(bundle, raw=True, display_id=True)
        return self.handle

    def start(self) -> LivePanel:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="monarch-panel")
            self._thread.start()
        return self

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._unsubscribe()

    def _run(self) -> None:
        try:
            ended = self._loop()
        finally:
            self._release()
        if ended:  # the cell finished (a --noblock one) or the cluster went down
            self.freeze()

    def _loop(self) -> bool:
        while not self._stop.is_set():
            try:
                self.stuck.poll(self.request)
                self.refresh(force=False)
                self.publish()
            except Exception:  # the cluster went down under us: the freeze shows what we have
                if self.ctl.closed:
                    return True
            if self.ctl.closed or (self.request is not None and not self.request.remaining):
                return True
            self._stop.wait(self.interval)
        return False

    def close(self) -> None:
        """Stop updating (the widget keeps its last values)."""
        self._stop.set()
        self._release()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def freeze(self) -> str:
        """Stop, draw the final picture (with everything the ranks logged so far), replace the
        displayed output with it, and close the widget; returns the picture's HTML. Once."""
        self.close()  # outside the lock: the panel's thread may be freezing it already
        with self._freeze_lock:
            if self.frozen is not None:
                return self.frozen
            try:
                if not self.ctl.closed:  # ranks that did not answer would not answer this
                    silent = self.ctl.unanswering
                    answering = [  # not a lost rank's worker: the scheduler would retry it
                        r.address for r in self.ctl.ranks if r.alive and r.rank not in silent
                    ]
                    self.ctl.metrics.catch_up(timeout=2, workers=answering)
                self.refresh()
                self.publish()
            except Exception:  # the cluster is gone: the last picture drawn stands
                pass
            self.frozen = self.html()
            if self.handle is not None:
                bundle = {"text/html": self.frozen, "text/plain": self.text()}
                self.handle.update(bundle, raw=True)
            self.widget.close()
        with _kept_lock:
            for entry in [e for e in _kept if e[0] is self]:
                _kept.remove(entry)
        return self.frozen

    def _ipython_display_(self) -> None:
        self.show()


_kept: collections.deque = collections.deque()  # (panel, display handle), oldest first
_kept_lock = threading.Lock()


def keep(panel: LivePanel, handle) -> None:
    """Keep ``panel`` live; past KEEP_PANELS, the oldest finished one shown is frozen (a panel
    whose cell ended freezes itself; this bounds the widgets of any that did not)."""
    panel.handle = handle
    with _kept_lock:
        _kept.append((panel, handle))
        old = []
        for entry in list(_kept):  # oldest first; a cell still running keeps its panel
            if len(_kept) - len(old) <= KEEP_PANELS:
                break
            if entry[0].request is None or not entry[0].request.remaining:
                old.append(entry)
    for stale, _ in old:
        stale.freeze()


class CellWatch:
    """Puts a live panel under a ``%%monarch`` cell: at once for ``--noblock`` cells, after
    SHOW_AFTER seconds for a blocking cell (short cells get no panel). Without a kernel (a
    terminal IPython) cells get none: the text output is the whole story there."""

    def __init__(self, ctl, block: bool):
        self.ctl, self.block = ctl, block
        self.panel: LivePanel | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._finished = False

    def __call__(self, request) -> None:
        if not widgets_available():
            return
        if self.block:
            self._timer = threading.Timer(SHOW_AFTER, self._show, args=(request,))
            self._timer.daemon = True
            self._timer.start()
        else:
            self._show(request)

    def _show(self, request) -> None:
        with self._lock:  # finish() may race the timer: a cell that ended gets no panel
            if self._finished or (self.block and not request.remaining):
                return
            self.panel = LivePanel(self.ctl, title=f"cell on {format_ranks(request.ranks)}")
            self.panel.track(request)
            keep(self.panel, self.panel.show())
            self.panel.start()

    def finish(self) -> None:
        with self._lock:
            self._finished = True
            if self._timer is not None:
                self._timer.cancel()
        if self.panel is not None and self.block:
            self.panel.freeze()
