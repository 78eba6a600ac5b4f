"""monarch_nb.show: a bokeh figure as a live widget with a text fallback, and decimation of
figures too large to draw. The browser side is in test_bokeh_browser.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from bokeh.layouts import column
from bokeh.plotting import figure

import monarch_nb
from monarch_nb.notebook import bokeh_display, plots

WIDGET = "application/vnd.jupyter.widget-view+json"


def test_show_is_public():
    assert monarch_nb.show is bokeh_display.show
    assert "show" in monarch_nb.__all__


def test_the_widget_carries_a_one_line_fallback_for_front_ends_without_widgets():
    from jupyter_bokeh import BokehModel

    fig = figure(title="loss")
    fig.line([0, 1, 2], [3.0, 2.0, 1.5])
    fig.scatter([0, 1, 2], [3.0, 2.0, 1.5])
    w = bokeh_display.widget(fig)
    assert isinstance(w, BokehModel)  # the model jupyter_bokeh's front end draws
    bundle = w._repr_mimebundle_()
    assert bundle[WIDGET]["model_id"] == w.model_id
    what = "bokeh figure 'loss' (1 line, 1 scatter, 6 points)"
    assert bundle["text/plain"] == f"{what}: {bokeh_display.NO_WIDGETS}"
    assert "\n" not in bundle["text/plain"]
    assert bundle["text/html"].startswith("<p><b>bokeh figure &#x27;loss&#x27;")
    assert "<script" not in bundle["text/html"]  # a static viewer shows it as it is


def test_a_layout_is_described_by_its_figures_in_reading_order():
    figs = [figure(title=t) for t in ("zeta", "alpha", "mid")]
    assert bokeh_display.describe(column(*figs)) == (
        "bokeh layout of 3 figures: 'zeta', 'alpha', 'mid'"
    )


def test_the_size_a_figure_is_laid_out_at_stays_in_the_page_and_its_ranges_come_back():
    """A page lays a figure out again as its notebook closes, after the kernel has gone, and
    jupyter_bokeh would send the new size to that kernel ("Cannot send" in the page)."""
    figs = [figure(title=t) for t in ("a", "b")]
    bokeh_display.widget(column(*figs))
    assert [f.syncable for f in figs] == [False, False]
    assert all(f.x_range.syncable and f.y_range.syncable for f in figs)


def test_show_refuses_what_is_not_a_bokeh_figure_in_one_line():
    with pytest.raises(TypeError, match=r"^monarch_nb.show draws a bokeh figure .* got ndarray$"):
        monarch_nb.show(np.zeros(3))


def test_a_line_of_millions_of_points_is_decimated_keeping_its_spikes(capsys):
    n = 3_000_000
    x = np.arange(n)
    y = np.sin(x / 1e4)
    y[1_234_567] = 50.0  # one spike a stride would miss
    y[2_000_000] = -50.0
    y[10:20] = np.nan
    fig = figure(title="loss")
    line = fig.line(x, y)
    bokeh_display.widget(fig, max_points=10_000)
    data = line.data_source.data
    kept = len(data["x"])
    assert 9_000 < kept <= 10_000
    assert data["y"].max() == 50.0 and data["y"].min() == -50.0
    assert data["x"][0] == 0 and data["x"][-1] == n - 1
    assert np.all(np.diff(data["x"]) > 0)  # still in order
    assert np.array_equal(data["y"], y[data["x"]])  # x and y stay paired
    note = capsys.readouterr().out.strip()
    assert note == (
        f"monarch_nb: a line of figure 'loss' has 3,000,000 points, too many to draw; drawing "
        f"{kept:,} (the lowest and highest point of each bucket). "
        "monarch_nb.show(fig, max_points=N) changes the limit."
    )


def test_scatter_and_list_columns_are_thinned_evenly_and_small_figures_untouched(capsys):
    fig = figure()
    dots = fig.scatter(list(range(250_000)), [float(i % 7) for i in range(250_000)])
    small = fig.line([0, 1, 2], [1, 2, 3])
    notes = bokeh_display.decimate(fig, max_points=1_000)
    assert len(notes) == 1 and "a scatter of the figure has 250,000 points" in notes[0]
    assert "every 250th point" in notes[0]
    data = dots.data_source.data
    assert isinstance(data["x"], list) and len(data["x"]) == 1_000
    assert data["x"][0] == 0 and data["x"][-1] == 249_999
    assert len(small.data_source.data["x"]) == 3
    assert bokeh_display.decimate(fig, max_points=1_000) == []  # nothing left to thin
    with pytest.raises(ValueError, match="max_points must be at least 4"):
        bokeh_display.decimate(fig, max_points=1)


def history(points: int):
    """What metrics.history() returns, for two ranks of ``points`` losses."""
    steps = list(range(points))
    series = {r: (steps, [1.0 / (1 + s + r) for s in steps]) for r in (0, 1)}
    return SimpleNamespace(names=lambda: ["loss"], series=lambda name: series)


def test_plot_save_is_self_contained_and_decimated(tmp_path, capsys):
    target = plots.save(history(300_000), str(tmp_path / "run.html"))
    page = target.read_text()
    # BokehJS inlined: no script or stylesheet from anywhere, so it opens from disk offline
    assert re.search(r"<script[^>]+src=", page) is None
    assert re.search(r"<link[^>]+href=", page) is None
    assert "Bokeh.embed.embed_items" in page
    notes = capsys.readouterr().out.strip().splitlines()
    assert len(notes) == 2 and all("has 300,000 points" in n for n in notes)
    assert len(page) < 20_000_000


def test_plot_show_is_the_widget_with_its_fallback():
    w = plots.show(history(5))
    bundle = w._repr_mimebundle_()
    assert WIDGET in bundle
    assert bundle["text/plain"].startswith("bokeh figure 'loss' (2 lines, 10 points)")
