"""Pictures of a collective for notebooks/01-ranks-and-collectives.ipynb: what each rank held
before it and after it, a row of boxes per rank, each value coloured by the rank it came from.

Kernel side only (bokeh); the ranks never import this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from bokeh.models import ColumnDataSource, LabelSet
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

MIXED = "#bbbbbb"  # a value made from every rank's (a sum)
BOX = 0.9  # a box's width, in value slots


def _colour(origin: int | None) -> str:
    return MIXED if origin is None else Category10_10[origin % 10]


def _boxes(held, origins, y: float, width: int) -> dict[str, list]:
    """The boxes of one row: rank r's values side by side from ``r * width``."""
    rows: dict[str, list] = {"x": [], "y": [], "colour": [], "text": []}
    for rank, (values, froms) in enumerate(zip(held, origins, strict=True)):
        for j, (value, origin) in enumerate(zip(values, froms, strict=True)):
            rows["x"].append(rank * width + j + 0.5)
            rows["y"].append(y)
            rows["colour"].append(_colour(origin))
            rows["text"].append(f"{value:g}")
    return rows


def collective_figure(
    title: str,
    before: Sequence[Sequence[float]],
    after: Sequence[Sequence[float]],
    after_from: Sequence[Sequence[int | None]],
):
    """A figure of a collective on ``len(before)`` ranks: the top row what each rank held
    before (each value in its rank's colour), the bottom row after, each value coloured by the
    rank it came from (``after_from``; ``None``: made from every rank's, drawn grey)."""
    before_from = [[rank] * len(values) for rank, values in enumerate(before)]
    width = max(len(values) for values in [*before, *after]) + 1  # a gap between ranks
    top = _boxes(before, before_from, 1.0, width)
    bottom = _boxes(after, after_from, 0.0, width)
    source = ColumnDataSource({k: top[k] + bottom[k] for k in top})
    fig = figure(
        title=title,
        width=max(420, 50 * width * len(before)),
        height=190,
        toolbar_location=None,
        x_range=(-0.2, width * len(before)),
        y_range=(-0.6, 1.6),
    )
    fig.rect("x", "y", BOX, 0.8, source=source, fill_color="colour", line_color="black")
    fig.add_layout(
        LabelSet(
            x="x", y="y", text="text", source=source, text_align="center", text_baseline="middle"
        )
    )
    fig.yaxis.ticker = [0, 1]
    fig.yaxis.major_label_overrides = {0: "after", 1: "before"}
    fig.xaxis.ticker = [rank * width + (width - 1) / 2 for rank in range(len(before))]
    fig.xaxis.major_label_overrides = {
        rank * width + (width - 1) / 2: f"rank {rank}" for rank in range(len(before))
    }
    fig.grid.visible = False
    return fig


def all_reduce_figure(before: Sequence[Sequence[float]], after: Sequence[Sequence[float]]):
    """An all-reduce (sum): every rank ends with the sum, made from every rank's values."""
    after_from = [[None] * len(values) for values in after]
    return collective_figure("all_reduce (sum): every rank gets the sum", before, after, after_from)


def broadcast_figure(before, after, src: int):
    """A broadcast from ``src``: every rank ends with ``src``'s values."""
    after_from = [[src] * len(values) for values in after]
    return collective_figure(f"broadcast from rank {src}", before, after, after_from)


def all_gather_figure(before, after):
    """An all-gather: every rank ends with every rank's values, in rank order."""
    sizes = [len(values) for values in before]
    origin = [rank for rank, size in enumerate(sizes) for _ in range(size)]
    after_from = [origin for _ in after]
    return collective_figure("all_gather: every rank gets every rank's", before, after, after_from)
