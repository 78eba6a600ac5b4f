"""The live panel's picture: one fixed-size inline SVG, drawn in Python, no JavaScript.

The same ``render(view)`` draws the live view (the value of an ``ipywidgets.HTML``), the frozen
snapshot a saved notebook keeps, and the static fallback where widgets cannot run. A view::

    view = panel_view(ctl.metrics.store.snapshot(points=400, samples=120), states)

has a row per rank (device, state, utilization, memory, step, loss), the loss per rank
against the step, and each rank's recent utilization and memory samples. The picture's size
depends only on the number of ranks, so an update never moves the page; text uses
``currentColor``, so it reads on light and dark themes; colours per rank are the sidebar's
(``figures.color``); only presentation attributes are used, no ``<style>`` or script. On a
cluster started with ``--ft`` the view has its ``ft`` feed too, and panel_ft.py draws each rank's
way back, the losses on the loss chart and the participants per step under it.
"""

from __future__ import annotations

import html
import time
from typing import Any

from monarch_nb.notebook import panel_charts as charts
from monarch_nb.notebook import panel_compact, panel_ft
from monarch_nb.notebook.panel_charts import FONT, GRID, MAX_POINTS, fmt
from monarch_nb.notebook.panel_charts import clip as _clip
from monarch_nb.notebook.panel_charts import finite as _finite
from monarch_nb.notebook.panel_charts import text as _t
from monarch_nb.telemetry.figures import GIB, color, rank_view

WIDTH = 900
HISTORY_S = 60.0  # seconds of utilization and memory history drawn
STATE_COLORS = {
    "running": "#1f77b4",
    "done": "#2ca02c",
    "error": "#d62728",
    "lost": "#d62728",
    "joining": "#ff7f0e",  # a fault-tolerant cell's rank on its way back (panel_ft.py)
    "healing": "#9467bd",
    "cancelled": "#7f7f7f",
    "queued": "#7f7f7f",
    "idle": "#7f7f7f",
    "up": "#2ca02c",
    "down": "#7f7f7f",
}
_HEAD = 26  # the title line
_CHART = 176  # the three charts under the rank rows
NO_LOSS = "no loss yet: monarch_nb.log(step=i, loss=...)"
NO_LOSS_IN_CELL = "no loss logged by this cell: monarch_nb.log(step=i, loss=...)"  # its panel


def panel_view(
    snapshot: dict[str, Any],
    states: dict[Any, tuple[str, float | None]] | None = None,
    ranks: list | None = None,
    now: float | None = None,
    cell: bool = False,
    ft: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The picture's data from a metrics snapshot (``Store.snapshot``) and the cell's
    ``rank -> (state, seconds running)``; ``ranks`` adds rows for ranks that logged nothing.
    ``cell``: the snapshot holds a cell's own rows (``rows_since``), and says so where none.
    ``ft``: on a cluster started with ``--ft``, its feed (``panel_ft.feed``)."""
    states = states or {}
    now = time.time() if now is None else now
    base = rank_view({"workers": [], "metrics": snapshot})
    rows = {row["rank"]: row for row in base["ranks"]}
    for rank in list(ranks or []) + list(states):
        rows.setdefault(rank, {"rank": rank, "util_of": "cpu"})
    logged = {e.get("rank"): e for e in snapshot.get("ranks") or []}
    out_rows, history = [], []
    ft_notes = panel_ft.notes(ft)
    for rank in sorted(rows, key=_order):
        row = dict(rows[rank])
        state, elapsed = states.get(rank, ("idle", None))
        row["state"], row["elapsed"] = state, elapsed
        entry = logged.get(rank) or {}
        # a None latest loss after steps were logged is a non-finite one (JSON has no NaN)
        values = entry.get("values") or {}
        row["loss_bad"] = "loss" in values and values["loss"] is None
        row["ft_note"] = ft_notes.get(rank)
        out_rows.append(row)
        samples = [s for s in entry.get("samples") or [] if s.get("time", now) >= now - HISTORY_S]
        if samples:
            util_key = "util" if any(s.get("util") is not None for s in samples) else "cpu"
            history.append(
                {
                    "rank": rank,
                    "t": [s.get("time", now) - now for s in samples],
                    "util": [s.get(util_key) for s in samples],
                    "mem": [
                        s["mem_used"] / GIB if _finite(s.get("mem_used")) else None for s in samples
                    ],
                }
            )
    loss = []
    for series in base["loss"]:
        entry = logged.get(series["rank"]) or {}
        loss.append({**series, "of": max(entry.get("rows") or 0, len(series["steps"]))})
    empty = NO_LOSS_IN_CELL if cell else NO_LOSS
    view = {"now": now, "ranks": out_rows, "loss": loss, "history": history, "no_loss": empty}
    if ft is not None:
        view["ft"] = ft
    return view


def _order(rank: Any) -> tuple:
    return (0, rank, "") if isinstance(rank, int) else (1, 0, str(rank))


# -- the parts of the picture ----------------------------------------------------------------
def _bar(x: float, y: float, w: float, frac: float | None, fill: str) -> str:
    part = (
        f'<rect x="{x}" y="{y}" width="{w}" height="10" rx="2" fill="currentColor" '
        'fill-opacity="0.1"/>'
    )
    if frac is not None and _finite(frac):
        filled = w * min(max(frac, 0.0), 1.0)
        part += f'<rect x="{x}" y="{y}" width="{filled:.1f}" height="10" rx="2" fill="{fill}"/>'
    return part


def _row(row: dict[str, Any], y: float, tall: bool) -> str:
    rank = row["rank"]
    c = color(rank)
    name = f"rank {rank}" if isinstance(rank, int) else str(rank)
    if row.get("labels"):  # its mesh coordinates, a pipeline stage's name
        name = f"{name} · {row['labels']}"
    device = row.get("device") or row.get("kind") or "no telemetry yet"
    where = " · ".join(p for p in (device, row.get("host")) if p)
    mid = y + (14 if tall else 9)
    parts = [f'<rect x="0" y="{y + 2}" width="4" height="{24 if tall else 14}" fill="{c}"/>']
    if tall:
        parts.append(_t(10, y + 12, _clip(name, 27), 12, font_weight="600"))
        parts.append(_t(10, y + 25, _clip(where, 38), 10, fill_opacity="0.7"))
    else:
        parts.append(_t(10, y + 13, _clip(f"{name} · {where}", 38), 11))
    state, elapsed = row.get("state") or "idle", row.get("elapsed")
    sc = STATE_COLORS.get(state, "#7f7f7f")
    label = f"{state} {elapsed:.1f} s" if _finite(elapsed) else state
    parts.append(
        f'<rect x="208" y="{mid - 8}" width="104" height="16" rx="8" fill="{sc}" '
        f'fill-opacity="0.15" stroke="{sc}" stroke-opacity="0.6"/>'
    )
    parts.append(_t(260, mid + 4, label, 11, "middle", fill=sc, font_weight="600"))
    util = row.get("util")
    what = "GPU" if row.get("util_of") == "gpu" else "CPU"
    parts.append(_t(320, mid + 4, what, 10, fill_opacity="0.7"))
    parts.append(_bar(346, mid - 5, 110, util / 100 if _finite(util) else None, c))
    parts.append(_t(462, mid + 4, f"{util:.0f}%" if _finite(util) else "–", 11))
    used, total = row.get("mem_used"), row.get("mem_total")
    frac = used / total if _finite(used) and _finite(total) and total else None
    parts.append(_t(500, mid + 4, "mem", 10, fill_opacity="0.7"))
    parts.append(_bar(526, mid - 5, 100, frac, c))
    mem = f"{used / GIB:.1f}/{total / GIB:.0f} GiB" if frac is not None else "–"
    parts.append(_t(632, mid + 4, mem, 11))
    loss = row.get("loss")
    if row.get("loss_bad"):
        loss_text = "loss not finite"
    elif _finite(loss):
        loss_text = f"loss {fmt(loss)}"
    else:
        loss_text = ""
    step = row.get("step")
    if row.get("ft_note"):  # lost at step 57, back at step 71: in place of the step
        loss_text = f"{row['ft_note']} · {loss_text}" if loss_text else row["ft_note"]
    elif step is not None:
        loss_text = f"step {step} · {loss_text}" if loss_text else f"step {step}"
    parts.append(_t(WIDTH - 2, mid + 4, _clip(loss_text, 34), 11, "end"))
    body = "".join(parts)
    return f'<g opacity="0.55">{body}</g>' if state == "lost" else body


def _lines(
    box: tuple[float, float, float, float],
    series: list[tuple[Any, list, list]],
    x_range: tuple[float, float] | None,
    y_floor: float | None,
    y_ceiling: float | None,
    title: str,
    x_label: str,
    empty: str,
    log_y: bool = False,
    marks: list = (),
) -> str:
    """A line chart in ``box`` (x, y, w, h), one line per rank in the rank's colour."""
    lines = [(rank, color(rank), list(zip(xs, ys, strict=False))) for rank, xs, ys in series]
    return charts.chart(
        box, lines, x_range, y_floor, y_ceiling, title, x_label, empty, log_y, marks=marks
    )


def _per_rank(view: dict[str, Any], h: int) -> list[str]:
    """A row per rank, and a line per rank in the charts under them (on an ft cluster, the
    participants per step under the loss)."""
    ranks = view["ranks"]
    tall = len(ranks) <= 8
    row_h = 30 if tall else 20
    parts = []
    y = _HEAD
    if not ranks:
        parts.append(_t(10, y + 14, "no ranks yet", 11, fill_opacity="0.6"))
    for row in ranks:
        parts.append(_row(row, y, tall))
        y += row_h
    ft = view.get("ft")
    top = h - _CHART - (panel_ft.HEIGHT if ft is not None else 0)
    parts.append(f'<line x1="0" x2="{WIDTH}" y1="{top - 5}" y2="{top - 5}" {GRID}/>')
    loss = view["loss"]
    xr = panel_ft.x_range([x for s in loss for x in s["steps"]], ft) if ft is not None else None
    ys = [v for s in loss for v in s["values"] if _finite(v)]
    log_y = bool(ys) and min(ys) > 0 and max(ys) / min(ys) >= 100
    # the store thins rows before they reach us; `of` is how many the rank logged
    thinned = any(max(len(s["steps"]), s["of"]) > MAX_POINTS for s in loss)
    loss_title = "loss" + (" (log scale)" if log_y else "")
    if thinned:
        loss_title += f" · thinned to {MAX_POINTS} points per rank"
    parts.append(
        _lines(
            (0, top, 430, _CHART - 4),
            [(s["rank"], s["steps"], s["values"]) for s in loss],
            xr,
            None,
            None,
            loss_title,
            "step",
            view.get("no_loss", NO_LOSS),
            log_y,
            panel_ft.marks(ft),
        )
    )
    if ft is not None:
        parts += panel_ft.draw(
            (0, top + _CHART, 430, panel_ft.HEIGHT - 4),
            (450, top + _CHART, WIDTH - 450, panel_ft.HEIGHT - 4),
            ft,
            xr,
        )
    hist = view["history"]
    window = (-HISTORY_S, 0.0)
    util_of = "GPU" if any(r.get("util_of") == "gpu" for r in ranks) else "CPU"
    parts.append(
        _lines(
            (450, top, 225, _CHART - 4),
            [(s["rank"], s["t"], s["util"]) for s in hist],
            window,
            0.0,
            100.0,
            f"{util_of} utilization %",
            "seconds ago",
            "no samples yet",
        )
    )
    parts.append(
        _lines(
            (WIDTH - 225, top, 225, _CHART - 4),
            [(s["rank"], s["t"], s["mem"]) for s in hist],
            window,
            0.0,
            None,
            "memory in use, GiB",
            "seconds ago",
            "no samples yet",
        )
    )
    return parts


def height(n_ranks: int, ft: bool = False) -> int:
    """The picture's height in pixels: it depends on the number of ranks only (and on whether
    the cluster has ``--ft``: the participants chart's strip)."""
    extra = panel_ft.HEIGHT if ft else 0
    if n_ranks >= panel_compact.COMPACT_RANKS:
        return _HEAD + panel_compact.HEIGHT + extra
    rows = n_ranks * (30 if n_ranks <= 8 else 20)
    return _HEAD + max(rows, 20) + 10 + _CHART + extra


def render(view: dict[str, Any], title: str, subtitle: str = "", note: str = "") -> str:
    """The panel as HTML: a fixed-size ``<svg>``, and ``note`` as a line of text under it; a
    row per rank, or from COMPACT_RANKS ranks the compact form (panel_compact.py)."""
    ranks = view["ranks"]
    h = height(len(ranks), view.get("ft") is not None)
    parts = [_t(0, 16, _clip(title, 60), 13, font_weight="700")]
    stamp = time.strftime("%H:%M:%S", time.localtime(view["now"]))
    right = f"{subtitle} · {stamp}" if subtitle else stamp
    parts.append(_t(WIDTH, 16, _clip(right, 80), 11, "end", fill_opacity="0.7"))
    if len(ranks) >= panel_compact.COMPACT_RANKS:
        parts += panel_compact.parts(view, WIDTH, _HEAD, STATE_COLORS)
    else:
        parts += _per_rank(view, h)
    # as wide as the output area up to its own width; the height follows the fixed aspect
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="-2 0 {WIDTH + 4} {h}" '
        f'font-family="{FONT}" class="monarch-panel-svg" style="display:block">'
        + "".join(parts)
        + "</svg>"
    )
    line = f'<div style="font-size:11px;opacity:0.75">{html.escape(note)}</div>' if note else ""
    # contain: a redraw inside lays out and paints only the panel, not the notebook around it
    style = f"max-width:{WIDTH + 4}px;contain:content"
    return f'<div class="monarch-panel" style="{style}">{svg}{line}</div>'


def text(view: dict[str, Any], title: str, note: str = "") -> str:
    """The panel as plain text, a line per rank (the ``text/plain`` of its outputs)."""
    lines = [title + (f" ({note})" if note else "")]
    if view.get("ft") is not None:
        lines.append(panel_ft.text_line(view["ft"]))
    if len(view["ranks"]) >= panel_compact.COMPACT_RANKS:
        return "\n".join(lines + panel_compact.text_lines(view))
    for row in view["ranks"]:
        util = row.get("util")
        used = row.get("mem_used")
        parts = [
            f"rank {row['rank']}",
            row.get("state") or "idle",
            row.get("device") or row.get("kind") or "-",
            f"util {util:.0f}%" if _finite(util) else "util -",
            f"mem {used / GIB:.1f} GiB" if _finite(used) else "mem -",
        ]
        if row.get("ft_note"):
            parts.append(row["ft_note"])
        if row.get("step") is not None:
            parts.append(f"step {row['step']}")
        if _finite(row.get("loss")):
            parts.append(f"loss {fmt(row['loss'])}")
        lines.append("  ".join(parts))
    return "\n".join(lines)
