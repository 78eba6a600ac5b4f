"""Any bokeh figure or layout in a notebook, offline: ``monarch_nb.show(fig)``.

bokeh's own ``show`` after ``output_notebook`` fetches BokehJS from a CDN, which the
compute and login nodes of most clusters cannot reach. Here the figure becomes a jupyter_bokeh
``BokehModel`` widget, and the lab extension loads BokehJS from the installed bokeh
(bokeh_static.py), so nothing leaves the machine; changes to the figure's data sources in the
kernel reach the drawn figure. The widget's output also carries text/html and text/plain, which
a front end without a widget manager (nbclient, nbviewer, GitHub, an untrusted notebook) shows
instead: one line saying what the figure is and why it is not drawn.

A source with more points than a browser draws comfortably is decimated first, with a note.

The size a figure is laid out at stays in the page (its plots are not ``syncable``): the page
lays a figure out again whenever its notebook panel resizes or closes, and jupyter_bokeh sends
each new size to the kernel, which throws "Cannot send" in the page once the kernel is shut
down (closing a notebook does both). What the figure shows still follows the kernel, and a
range the reader zooms is still sent back.
"""

from __future__ import annotations

import html
import math
from functools import cache
from typing import Any

MAX_POINTS = 100_000  # per data source; a canvas takes seconds past a few hundred thousand

NO_WIDGETS = (
    "a live bokeh widget: this viewer cannot run Jupyter widgets; open the notebook in "
    "JupyterLab or Notebook 7 and run the cell to draw it"
)


def show(obj, *, max_points: int = MAX_POINTS) -> None:
    """Display a bokeh figure or layout under the cell, as a live widget. A data source with
    more than ``max_points`` rows is decimated in place, with a note saying so.

    >>> from bokeh.plotting import figure
    >>> fig = figure(title="loss")
    >>> line = fig.line(steps, losses)
    >>> monarch_nb.show(fig)
    >>> line.data_source.stream({"x": [next_step], "y": [next_loss]})  # drawn figure follows
    """
    from IPython.display import display

    display(widget(obj, max_points=max_points))


def widget(obj, *, max_points: int = MAX_POINTS):
    """The object ``show`` displays: a ``BokehModel`` with a text fallback, or, where
    jupyter_bokeh is not installed, the figure as standalone HTML with BokehJS inlined."""
    from bokeh.models import LayoutDOM, Plot

    if not isinstance(obj, LayoutDOM):
        raise TypeError(
            f"monarch_nb.show draws a bokeh figure or layout (bokeh.plotting.figure(), "
            f"column(...)); got {type(obj).__name__}"
        )
    for note in decimate(obj, max_points):
        print(note)
    for plot in _plots_in_order(obj, Plot):
        plot.syncable = False  # its inner_width and the like, laid out anew as the page closes
    try:
        widget_class = _figure_widget()
    except ImportError:
        from bokeh.embed import file_html
        from bokeh.resources import INLINE
        from IPython.display import HTML

        return HTML(file_html(obj, INLINE, describe(obj)))
    return widget_class(obj)


@cache
def _figure_widget():
    """The widget class, made on first use: jupyter_bokeh pulls in ipywidgets, which
    ``import monarch_nb`` should not pay for."""
    from jupyter_bokeh import BokehModel

    class FigureWidget(BokehModel):
        """A BokehModel whose output says what it is where widgets cannot render: front ends
        pick the widget where they have a widget manager, else text/html or text/plain."""

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs) or {}
            what = describe(self._model)
            bundle["text/plain"] = f"{what}: {NO_WIDGETS}"
            bundle["text/html"] = f"<p><b>{html.escape(what)}</b>: {html.escape(NO_WIDGETS)}</p>"
            return bundle

    return FigureWidget


def describe(obj) -> str:
    """``bokeh figure 'loss' (2 lines, 1,000 points)``, or a layout's figures by title."""
    from bokeh.models import ColumnDataSource, GlyphRenderer, Plot

    plots = _plots_in_order(obj, Plot)
    if len(plots) == 1:
        plot = plots[0]
        title = plot.title.text if plot.title is not None and plot.title.text else ""
        glyphs: dict[str, int] = {}
        for r in plot.select({"type": GlyphRenderer}):
            name = type(r.glyph).__name__.lower()
            glyphs[name] = glyphs.get(name, 0) + 1
        points = sum(_rows(s) for s in plot.select({"type": ColumnDataSource}))
        parts = [f"{n} {g}{'s' if n > 1 else ''}" for g, n in sorted(glyphs.items())]
        parts.append(f"{points:,} points")
        label = f"bokeh figure {title!r}" if title else "bokeh figure"
        return f"{label} ({', '.join(parts)})"
    titles = [p.title.text for p in plots if p.title is not None and p.title.text]
    named = f": {', '.join(repr(t) for t in titles)}" if titles else ""
    return f"bokeh layout of {len(plots)} figures{named}"


def _plots_in_order(obj, plot_type) -> list:
    """The figures of a layout as a reader sees them (``select`` answers in set order)."""
    if isinstance(obj, plot_type):
        return [obj]
    children = getattr(obj, "children", None) or getattr(obj, "tabs", None) or []
    found = []
    for child in children:
        child = child[0] if isinstance(child, tuple) else getattr(child, "child", child)
        found += [p for p in _plots_in_order(child, plot_type) if p not in found]
    rest = [p for p in obj.select({"type": plot_type}) if p not in found]
    return found + rest


def _rows(source) -> int:
    return max((len(column) for column in source.data.values()), default=0)


def decimate(obj, max_points: int = MAX_POINTS) -> list[str]:
    """Thin every data source of ``obj`` with more than ``max_points`` rows, in place, and say
    so: a line keeps each bucket's lowest and highest point (its spikes survive), anything else
    every k-th row. Returns one note per source it thinned."""
    from bokeh.models import ColumnDataSource, GlyphRenderer, Plot

    if max_points < 4:
        raise ValueError(f"max_points must be at least 4; got {max_points}")
    notes = []
    renderers = list(obj.select({"type": GlyphRenderer}))
    drawn_by = {}  # id of a source -> what draws it, for the note
    for plot in obj.select({"type": Plot}):
        title = plot.title.text if plot.title is not None and plot.title.text else ""
        where = f"figure {title!r}" if title else "the figure"
        for r in plot.select({"type": GlyphRenderer}):
            drawn_by.setdefault(r.data_source.id, f"a {type(r.glyph).__name__.lower()} of {where}")
    for source in obj.select({"type": ColumnDataSource}):
        n = _rows(source)
        if n <= max_points or not _columnar(source.data, n):
            continue
        line_y = _line_field(source, renderers)
        kept = _min_max(source.data[line_y], max_points) if line_y else None
        how = "the lowest and highest point of each bucket"
        if kept is None:
            kept = _every_kth(n, max_points)
            how = f"every {math.ceil(n / max_points)}th point"
        source.data = {name: _take(column, kept) for name, column in source.data.items()}
        label = drawn_by.get(source.id, "a data source")
        notes.append(
            f"monarch_nb: {label} has {n:,} points, too many to draw; drawing {len(kept):,} "
            f"({how}). monarch_nb.show(fig, max_points=N) changes the limit."
        )
    return notes


def _columnar(data: dict[str, Any], n: int) -> bool:
    return all(len(column) == n for column in data.values())


def _line_field(source, renderers) -> str | None:
    """The y column of a line drawn from ``source``, if one is."""
    from bokeh.models import Line, Step

    for r in renderers:
        if r.data_source is source and isinstance(r.glyph, Line | Step):
            y = r.glyph.y
            field = y if isinstance(y, str) else getattr(y, "field", None)
            if field in source.data:
                return field
    return None


def _every_kth(n: int, max_points: int):
    import numpy as np

    return np.unique(np.linspace(0, n - 1, max_points).astype(np.int64))


def _min_max(column, max_points: int):
    """Indices of each bucket's minimum and maximum, with the first and last row; None when
    the column is not numbers."""
    import numpy as np

    try:
        y = np.asarray(column, dtype=float)
    except (TypeError, ValueError):
        return None
    n = len(y)
    size = math.ceil(n / (max_points // 2 - 1))  # 2 picks a bucket, plus both ends
    buckets = math.ceil(n / size)
    pad = buckets * size - n
    # NaN never wins: a gap stays a gap only where a whole bucket is NaN
    low = np.pad(np.where(np.isnan(y), np.inf, y), (0, pad), constant_values=np.inf)
    high = np.pad(np.where(np.isnan(y), -np.inf, y), (0, pad), constant_values=-np.inf)
    base = np.arange(buckets) * size
    picks = np.concatenate(
        [
            base + low.reshape(buckets, size).argmin(axis=1),
            base + high.reshape(buckets, size).argmax(axis=1),
            [0, n - 1],
        ]
    )
    return np.unique(np.clip(picks, 0, n - 1))


def _take(column, kept):
    import numpy as np

    if isinstance(column, np.ndarray):
        return column[kept]
    return [column[i] for i in kept]
