"""``%monarch plot``: what the ranks logged, as static bokeh figures for reports.

One figure per logged name, one line per rank; shown in the notebook as a live widget
(bokeh_display.py: no CDN) or written to a standalone HTML file with bokeh's JavaScript inlined
(it opens from disk with no network). Either way a run too long to draw is decimated, with a note.
"""

from __future__ import annotations

from pathlib import Path

from monarch_nb.notebook import bokeh_display
from monarch_nb.telemetry.figures import color


def history_layout(history):
    """A column of figures, one per scalar name in ``history`` (a metrics.History)."""
    from bokeh.layouts import column
    from bokeh.models import HoverTool
    from bokeh.plotting import figure

    figs = []
    for name in history.names():
        fig = figure(
            title=name,
            height=260,
            sizing_mode="stretch_width",
            tools="pan,wheel_zoom,box_zoom,reset,save",
        )
        for rank, (steps, values) in sorted(
            history.series(name).items(), key=lambda kv: str(kv[0])
        ):
            fig.line(
                steps, values, line_color=color(rank), line_width=2, legend_label=f"rank {rank}"
            )
        fig.add_tools(HoverTool(tooltips=[("step", "$x{0}"), (name, "$y")]))
        fig.xaxis.axis_label = "step"
        fig.legend.click_policy = "hide"
        figs.append(fig)
    return column(*figs, sizing_mode="stretch_width")


def save(history, path: str) -> Path:
    """Write the figures to ``path`` (.html)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    target = Path(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"plot --save writes a standalone .html file; got {path!r}")
    layout = history_layout(history)
    for note in bokeh_display.decimate(layout):
        print(note)
    target.write_text(file_html(layout, INLINE, "monarch-nb metrics"))
    return target.resolve()


def show(history):
    """The figures as a widget (``bokeh_display.widget``); the magic returns it as the cell's
    value, so the notebook draws it."""
    return bokeh_display.widget(history_layout(history))
