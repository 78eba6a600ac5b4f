"""The live notebook panel: a bar per rank for utilization and memory (device names shown), the
loss with one line per rank, and each rank's cell state.

Built from existing widgets (ipywidgets, and bokeh figures from ``figures`` rendered through
``jupyter_bokeh``); values change in place on their data sources, never redrawn, at most
``hz`` times a second however fast the metrics arrive. Where widgets are unavailable the panel
falls back to text.
"""

from __future__ import annotations

import collections
import html
import threading
import time

from . import figures
from .targets import format_ranks

DEFAULT_HZ = 2.0
SHOW_AFTER = 1.0  # seconds a blocking cell runs before its panel appears
LOSS_POINTS = 400  # points per rank in the loss chart (evenly thinned, newest kept)
KEEP_PANELS = 8  # cells' panels kept live; older ones become a snapshot, their widgets closed
_STATE_COLORS = {
    "running": "#1f77b4",
    "done": "#2ca02c",
    "error": "#d62728",
    "lost": "#d62728",
    "cancelled": "#7f7f7f",
    "queued": "#7f7f7f",
}


def widgets_available() -> bool:
    """ipywidgets and jupyter_bokeh import, and a Jupyter kernel will render them."""
    try:
        import ipywidgets  # noqa: F401
        import jupyter_bokeh  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class LivePanel:
    """A live view of one cluster; ``track(request)`` adds the state of a running cell."""

    def __init__(self, ctl, hz: float = DEFAULT_HZ, title: str = "monarch-nb"):
        from bokeh.models import ColumnDataSource
        from ipywidgets import HTML, VBox
        from jupyter_bokeh import BokehModel

        self.ctl = ctl
        self.interval = 1.0 / hz
        self.title = title
        self.request = None
        self.updates = 0  # how many times the values changed (tests read it)
        self._bars = ColumnDataSource(figures.bar_columns({"ranks": []}))
        self._loss = ColumnDataSource(figures.loss_columns({"loss": []}))
        self.header = HTML()
        self.states = HTML()
        self.figures = BokehModel(figures.layout(self._bars, self._loss))
        self.widget = VBox([self.header, self.states, self.figures])
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics_news = False
        self._unsubscribe = ctl.metrics.subscribe(self._on_metrics)
        self._released = False
        self.refresh()

    def _on_metrics(self, _event) -> None:
        self._metrics_news = True
        self._dirty.set()

    # -- what the panel shows --------------------------------------------------------------
    def track(self, request) -> None:
        """Show the state of ``request`` (a cell) on each of its ranks until it finishes."""
        self.request = request
        self._dirty.set()

    def cell_states(self) -> dict[int, tuple[str, float | None]]:
        """rank -> (state, seconds since the cell started)."""
        req = self.request
        if req is None:
            return {}
        now = time.time()
        states = {}
        for rank in req.ranks:
            status = req.status.get(rank)
            if status is None and rank in req.remaining:
                states[rank] = ("running", now - req.t0)
            else:
                states[rank] = ({"ok": "done"}.get(status, status or "done"), None)
        return states

    def refresh(self, force: bool = True) -> None:
        """Read the hub (the updating thread: only when it has news) and change the figures'
        data in place."""
        if force or self._metrics_news:
            self._metrics_news = False
            snapshot = self.ctl.metrics.store.snapshot(points=LOSS_POINTS, samples=0)
            view = figures.rank_view({"workers": [], "metrics": snapshot})
            states = self.cell_states()
            for row in view["ranks"]:  # the hover's state: the cell's, not the scheduler's
                state = states.get(row["rank"])
                row["status"] = state[0] if state else "idle"
            self._bars.data = figures.bar_columns(view)
            self._loss.data = figures.loss_columns(view)
            self.updates += 1
        self.header.value = self._header_html()
        self.states.value = self._states_html()

    def _header_html(self) -> str:
        state = "down" if self.ctl.closed else f"{self.ctl.world_size} ranks"
        return (
            f"<b>{html.escape(self.title)}</b> &middot; {html.escape(state)} at "
            f"<code>{html.escape(str(self.ctl.scheduler_address))}</code>"
        )

    def _states_html(self) -> str:
        states = self.cell_states()
        if not states:
            return ""
        cells = []
        for rank, (state, elapsed) in sorted(states.items()):
            color = _STATE_COLORS.get(state, "#333")
            since = f" {elapsed:.1f} s" if elapsed is not None else ""
            cells.append(
                f'<span style="margin-right:1em;color:{color}">rank {rank}: '
                f"{html.escape(state)}{since}</span>"
            )
        return "<div>" + "".join(cells) + "</div>"

    # -- running -----------------------------------------------------------------------------
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
            self._loop()
        finally:
            self._release()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.interval)
            self._dirty.clear()
            try:
                self.refresh(force=False)
            except Exception:  # the cluster went down under us: show what we have
                if self.ctl.closed:
                    break
            if self.request is not None and not self.request.remaining:
                self.refresh()
                break
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop updating (the widget keeps its last values)."""
        self._stop.set()
        self._dirty.set()
        self._release()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def dispose(self) -> str:
        """Stop, close the widgets (their comms and models in the kernel and the browser), and
        return a static snapshot of the header and states to show in their place."""
        self.close()
        snapshot = (
            f"<div>{self.header.value}{self.states.value}<i>live panel closed to free its "
            "widgets; %monarch plot shows what the ranks logged</i></div>"
        )
        from ipywidgets import Widget

        for widget in (self.widget, self.header, self.states):
            widget.close()
        # The comm only: jupyter_bokeh's own close() also unhooks the widget from its bokeh
        # document, and raises KeyError when its __del__ calls it a second time.
        Widget.close(self.figures)
        return snapshot

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


_kept: collections.deque = collections.deque()  # (panel, display handle), oldest first
_kept_lock = threading.Lock()


def keep(panel: LivePanel, handle) -> None:
    """Keep ``panel`` live; past KEEP_PANELS, the oldest one shown becomes its snapshot (each
    panel holds ten widgets, which would otherwise pile up for as long as the kernel runs)."""
    with _kept_lock:
        _kept.append((panel, handle))
        old = []
        for entry in list(_kept):  # oldest first; a cell still running keeps its panel
            if len(_kept) - len(old) <= KEEP_PANELS:
                break
            if entry[0].request is None or not entry[0].request.remaining:
                old.append(entry)
        for entry in old:
            _kept.remove(entry)
    for stale, stale_handle in old:
        snapshot = stale.dispose()
        stale_handle.update({"text/html": snapshot, "text/plain": "monarch-nb panel"}, raw=True)


class CellWatch:
    """Puts a live panel under a ``%%monarch`` cell: at once for ``--noblock`` cells, after
    SHOW_AFTER seconds for a blocking cell (short cells get no panel)."""

    def __init__(self, ctl, block: bool):
        self.ctl, self.block = ctl, block
        self.panel: LivePanel | None = None
        self._timer: threading.Timer | None = None

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
        if self.block and not request.remaining:
            return
        from IPython.display import display

        self.panel = LivePanel(self.ctl, title=f"cell on {format_ranks(request.ranks)}")
        self.panel.track(request)
        keep(self.panel, display(self.panel.widget, display_id=True))
        self.panel.start()

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.panel is not None and self.block:
            self.panel.refresh()
            self.panel.close()
