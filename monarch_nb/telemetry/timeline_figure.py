"""What a profiled cell (``%%monarch --profile``) shows: one timeline of every rank's compute,
collectives and idle time on the controller's clock, with the numbers in a table under it
(``layout``), and the plain-text form a front end without widgets shows (``text``).

A row per rank, rank 0 on top: compute in the row's upper part and collectives in its lower
part, so that overlap shows as both at once; idle light grey behind both. From COMPACT_RANKS
ranks the rows are thinner, grouped by host, and the step labels move to a header row.
"""

from __future__ import annotations

import html
import math
import statistics
from typing import Any

from bokeh.layouts import column
from bokeh.models import (
    BoxAnnotation,
    ColumnDataSource,
    Div,
    FixedTicker,
    HoverTool,
    Legend,
    LegendItem,
    LinearAxis,
    Range1d,
)
from bokeh.plotting import figure

from monarch_nb.telemetry import profile_spans
from monarch_nb.telemetry.profile_model import Analysis, Timeline

COMPACT_RANKS = 16  # as the live panel (panel_compact.py): from here rows are grouped by host
ROW_PX, COMPACT_ROW_PX = 64, 18
MAX_FRAME_PX = 900  # the plot stops growing here; its rows get thinner instead
MIN_LABEL_PX = 12  # rows thinner than this label every k-th rank and each host's first
NOMINAL_PX = 800  # the plot's width that a step label's room is judged at, over the first view
TEXT_ROWS = 16  # ranks listed by text(); past it the slowest, the fastest and the median
COMPUTE, IDLE = "#4e79a7", "#d9d9d9"
# a colour per collective, none near the compute blue or the idle grey; "other" last
COLLECTIVES = {
    "all_reduce": "#e15759",
    "all_gather": "#f28e2b",
    "reduce_scatter": "#b07aa1",
    "all_to_all": "#76b7b2",
    "broadcast": "#59a14f",
    "send/recv": "#edc948",
    "barrier": "#9c755f",
    "other": "#ff9da7",
}
# (top, bottom) of each kind's bars, in rows down from the row's middle
_ROOMY = {"compute": (-0.2, 0.14), "comm": (0.16, 0.47), "idle": (-0.2, 0.47)}
_COMPACT = {"compute": (-0.45, -0.01), "comm": (0.01, 0.45), "idle": (-0.45, 0.45)}
TOOLTIPS = [
    ("op", "@name"),
    ("kind", "@what"),
    ("duration", "@dur_text"),
    ("step", "@step_text"),
    ("rank", "@rank_text"),
    ("start", "@start_text"),
]


def collective(name: str) -> str:
    """Which of COLLECTIVES an op is, whatever its backend calls it (the analysis's plain name
    first: FSDP's "FSDP::post_backward_reduce (0)" is a reduce_scatter)."""
    flat = "".join(c for c in profile_spans.collective(name) if c.isalnum())
    words = {kind: kind.replace("_", "").split("/") for kind in COLLECTIVES}
    return next((kind for kind, w in words.items() if any(x in flat for x in w)), "other")


def rank_label(rank: int, status: str) -> str:
    """``rank 2 · error``: a rank whose cell did not end well says so on its row."""
    if status == "ok":
        return f"rank {rank}"
    return f"rank {rank} · {'lost (no trace)' if status == 'lost' else status}"


def ms(x: float | None) -> str:
    """Three significant digits, never an exponent: 1234, 12.3, 0.0123."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.{max(2 - math.floor(math.log10(abs(x))), 0)}f}"


def order(t: Timeline) -> list[int]:
    """The rows top to bottom: by rank, and from COMPACT_RANKS each host's ranks together (in
    the order of each host's first rank, so that rank 0 stays on top)."""
    if len(t.ranks) < COMPACT_RANKS:
        return list(t.ranks)
    first: dict[str, int] = {}
    for i, r in enumerate(t.ranks):
        first.setdefault(t.hosts.get(r, ""), i)
    return sorted(t.ranks, key=lambda r: first[t.hosts.get(r, "")])


def host_runs(t: Timeline, rows: list[int]) -> list[tuple[str, int, int]]:
    """(host, first row, last row) of each run of rows on one host."""
    runs: list[tuple[str, int, int]] = []
    for i, r in enumerate(rows):
        host = t.hosts.get(r) or "?"
        if runs and runs[-1][0] == host:
            runs[-1] = (host, runs[-1][1], i)
        else:
            runs.append((host, i, i))
    return runs


def labelled(runs: list[tuple[str, int, int]], row_px: float) -> list[int]:
    """The rows whose rank is written: all where rows are tall enough, else each host's first
    and every k-th after it that keeps clear of the next host's first."""
    k = max(math.ceil(MIN_LABEL_PX / row_px), 1)
    return [i for _, a, b in runs for i in range(a, b + 1) if (i - a) % k == 0 and b + 1 - i >= k]


def _measured(t: Timeline) -> tuple[float, float] | None:
    """Where the measured (not warm-up) steps lie, over every rank."""
    counted = [
        (a, b)
        for a, b, warm in zip(t.steps["start"], t.steps["end"], t.steps["warmup"], strict=True)
        if not warm
    ]
    return (min(a for a, _ in counted), max(b for _, b in counted)) if counted else None


def layout(analysis: Analysis, title: str):
    """The timeline with the numbers' table under it, for ``bokeh_display.show``."""
    t = analysis.timeline
    rows = order(t)
    n = max(len(rows), 1)
    compact = len(rows) >= COMPACT_RANKS
    header = 1.0 if compact else 0.0  # a row above rank 0 for the step labels
    row_px = min(COMPACT_ROW_PX if compact else ROW_PX, MAX_FRAME_PX / (n + header))
    where = {r: i for i, r in enumerate(rows)}
    x0, x1 = _span(t)
    pad = (x1 - x0) * 0.01 or 1.0
    # shown first: the measured steps; the warm-up, which can be long, is a pan or a zoom away
    m0, m1 = _measured(t) or (x0, x1)
    fig = figure(
        title=title,
        sizing_mode="stretch_width",
        frame_height=round(row_px * (n + header)),
        x_range=Range1d(m0 - pad, m1 + pad, bounds=(x0 - pad, x1 + pad)),
        y_range=Range1d(-(n - 0.5), 0.5 + header),
        tools="xpan,xwheel_zoom,reset",
        toolbar_location="above",
    )
    fig.toolbar.logo = "grey"  # with none, bokeh 3.9 folds the hover button into a menu
    fig.xaxis.axis_label = f"ms (ranks' clocks aligned within ±{ms(t.align_error_us)} µs)"
    fig.ygrid.ticker = FixedTicker(ticks=[-i - 0.5 for i in range(n - 1)])  # between rows
    runs = host_runs(t, rows)
    _hosts(fig, runs)
    shown = labelled(runs, row_px)
    axis = fig.left[0]  # fig.yaxis is the hosts' axis too
    axis.ticker = FixedTicker(ticks=[-i for i in shown], minor_ticks=[])
    status = [t.status.get(r, "ok") for r in rows]
    axis.major_label_overrides = {-i: rank_label(rows[i], status[i]) for i in shown}
    axis.major_label_text_font_size = "11px" if row_px >= MIN_LABEL_PX else "9px"
    items = _bars(fig, t, where, _COMPACT if compact else _ROOMY)
    items += _steps(fig, t, rows, where, compact, m1 - m0)
    _missing(fig, t, rows, (m0 + m1) / 2)
    legend = Legend(items=items, click_policy="hide", label_text_font_size="11px", spacing=2)
    fig.add_layout(legend, "right")
    fig.frame_height = max(fig.frame_height, 22 * len(items) + 20)  # the legend fits beside it
    return column(fig, Div(text=table_html(analysis)), sizing_mode="stretch_width")


def _span(t: Timeline) -> tuple[float, float]:
    starts = list(t.bars.get("start", [])) + list(t.steps.get("start", []))
    ends = list(t.bars.get("end", [])) + list(t.steps.get("end", []))
    return (min(starts), max(ends)) if starts and ends else (0.0, 1.0)


def _hosts(fig, runs: list[tuple[str, int, int]]) -> None:
    """On more than one host: every other host's rows shaded, and its name on the right."""
    if len(runs) < 2:
        return
    for k, (_, a, b) in enumerate(runs):
        if k % 2:
            fig.add_layout(
                BoxAnnotation(top=-a + 0.5, bottom=-b - 0.5, fill_color="#000000", fill_alpha=0.05)
            )
    centres = {-(a + b) / 2: f"{h[:20]} · {b - a + 1}" for h, a, b in runs}
    axis = LinearAxis(ticker=FixedTicker(ticks=list(centres), minor_ticks=[]))
    axis.major_label_overrides = centres
    axis.major_tick_line_color = axis.axis_line_color = None
    axis.major_label_text_font_size = "10px"
    fig.add_layout(axis, "right")


def _columns(names: str, rows: list[tuple]) -> dict[str, list]:
    """Rows of values as a data source's columns, named by ``names`` ("x y0 y1")."""
    return dict(zip(names.split(), map(list, zip(*rows, strict=True)), strict=True))


_BAR = "left right top bottom name what dur_text step_text rank_text start_text"


def _bars(fig, t: Timeline, where: dict[int, int], band: dict) -> list:
    """Idle, compute and each collective's bars, one renderer each; their legend items."""
    groups: dict[str, list[tuple]] = {}
    b = t.bars
    for k, rank in enumerate(b.get("rank", [])):
        if rank not in where:
            continue
        kind, name, step, start = b["kind"][k], b["name"][k], b["step"][k], b["start"][k]
        group = collective(name) if kind == "comm" else kind
        top, bottom = band.get(kind, band["idle"])
        groups.setdefault(group, []).append(
            (
                start,
                b["end"][k],
                -where[rank] - top,
                -where[rank] - bottom,
                name,
                f"comm ({group})" if kind == "comm" else kind,
                f"{ms(b['dur'][k])} ms",
                str(step) if step >= 0 else "outside the steps",
                rank_label(rank, t.status.get(rank, "ok")),
                f"{ms(start)} ms",
            )
        )
    colours = {"idle": IDLE, "compute": COMPUTE, **COLLECTIVES}
    drawn = {}
    for group in ("idle", "compute", *COLLECTIVES):  # idle first: behind the others
        if group in groups:
            source = ColumnDataSource(_columns(_BAR, groups[group]))
            drawn[group] = fig.quad(
                source=source, color=colours[group], line_color=None, name=group
            )
    if drawn:
        fig.add_tools(HoverTool(renderers=list(drawn.values()), tooltips=TOOLTIPS))
    legend = [g for g in ("compute", *COLLECTIVES, "idle") if g in drawn]
    return [LegendItem(label=g, renderers=[drawn[g]]) for g in legend]


def _steps(fig, t: Timeline, rows: list[int], where: dict, compact: bool, span: float) -> list:
    """A tick at each step's start, warm-up steps greyed, and "step N" where it fits: in each
    row, or from COMPACT_RANKS in the header row (the top row's steps)."""
    s = t.steps
    ticks, warm, labels = [], [], []
    have = set(s.get("rank", []))
    top_rank = next((r for r in rows if r in have), None)
    for k, rank in enumerate(s.get("rank", [])):
        if rank not in where:
            continue
        i, start, end, warmup = where[rank], s["start"][k], s["end"][k], s["warmup"][k]
        ticks.append((start, -i + 0.5, -i - 0.5))
        if warmup:
            warm.append((start, end, -i + 0.5, -i - 0.5))
        text = "warm-up" if warmup else f"step {s['step'][k]}"
        room = (end - start) / (span or 1.0) * NOMINAL_PX
        if room >= 6 * len(text) + 8 and (not compact or rank == top_rank):
            labels.append((start, 1.0 if compact else -i + 0.47, text))
    if compact:  # the header's own ticks
        ticks += [(x, 1.5, 0.5) for x, _, _ in labels]
    items = []
    if warm:
        r = fig.quad(source=_columns("left right top bottom", warm), line_color=None)
        r.glyph.update(fill_color="#ffffff", fill_alpha=0.6, hatch_pattern="/")
        r.glyph.update(hatch_color="#999999", hatch_alpha=0.4)
        items.append(LegendItem(label="warm-up (not counted)", renderers=[r]))
    if ticks:
        source = _columns("x y0 y1", ticks)
        fig.segment(x0="x", x1="x", y0="y0", y1="y1", source=source, color="#444444", alpha=0.7)
    if labels:
        fig.text(
            x="x",
            y="y",
            text="text",
            source=_columns("x y text", labels),
            x_offset=3,
            text_baseline="middle" if compact else "top",
            text_font_size="10px",
            text_color="#555555",
        )
    return items


def _missing(fig, t: Timeline, rows: list[int], middle: float) -> None:
    """The words "no trace" across the row of a rank that left none."""
    have = set(t.bars.get("rank", []))
    gone = [i for i, r in enumerate(rows) if r not in have]
    if not gone:
        return
    words = ["no trace" if t.status.get(rows[i]) == "lost" else "no events" for i in gone]
    fig.text(
        x=[middle] * len(gone),
        y=[-i for i in gone],
        text=words,
        text_align="center",
        text_baseline="middle",
        text_font_size="11px",
        text_font_style="italic",
        text_color="#888888",
    )


# -- the numbers -----------------------------------------------------------------------------
HEADERS = ("rank", "steps", "step ms", "compute ms", "%", "comm ms", "%", "idle ms", "%", "overlap")


def cells(row: dict[str, Any]) -> list[str]:
    """A row of ``Numbers.rows`` as the table writes it."""
    step = row.get("step_ms")
    steps = row.get("steps")
    out = [str(row.get("rank", "–")), f"{steps:g}" if steps is not None else "–", ms(step)]
    for key in ("compute_ms", "comm_ms", "idle_ms"):
        x = row.get(key)
        out += [ms(x), f"{100 * x / step:.0f}%" if x is not None and step else "–"]
    overlap = row.get("overlap")
    return [*out, f"{100 * overlap:.0f}%" if overlap is not None else "–"]


def footer(analysis: Analysis) -> list[str]:
    """The lines under the table: where the numbers come from, the clocks, what was left out."""
    t, nums = analysis.timeline, analysis.numbers
    away = [rank_label(r, t.status[r]) for r in t.ranks if t.status.get(r, "ok") != "ok"]
    return [
        f"numbers from: {nums.source} · clocks aligned within ±{ms(t.align_error_us)} µs",
        *([f"not ok: {', '.join(away)}"] if away else []),
        *([t.left_out] if t.left_out else []),
        *nums.notes,
    ]


def table_html(analysis: Analysis) -> str:
    """The numbers as an HTML table (every rank, scrolling past a screenful), the straggler
    sentence above it and its row highlighted; every string escaped."""
    nums = analysis.numbers
    out = []
    if nums.straggler:
        out.append(
            '<p style="background:#fdecea;border-left:4px solid #e15759;padding:4px 8px;'
            f'margin:4px 0"><b>{html.escape(nums.straggler)}</b></p>'
        )
    head = "".join(f'<th style="padding:2px 8px">{html.escape(h)}</th>' for h in HEADERS)
    body = []
    for row in nums.rows:
        hot = row.get("rank") == nums.straggler_rank and nums.straggler_rank is not None
        style = ' style="background:#fdecea;font-weight:600"' if hot else ""
        tds = "".join(f'<td style="padding:1px 8px">{html.escape(c)}</td>' for c in cells(row))
        body.append(f"<tr{style}>{tds}</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(HEADERS)}">no rank left a trace</td></tr>')
    out.append(
        '<div style="max-height:360px;overflow-y:auto"><table style="border-collapse:collapse;'
        'font-size:12px;text-align:right;font-variant-numeric:tabular-nums">'
        f'<thead style="position:sticky;top:0;background:#fff"><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
    out += [f'<p style="margin:2px 0;color:#555">{html.escape(x)}</p>' for x in footer(analysis)]
    return "".join(out)


def text(analysis: Analysis, directory: str | None) -> str:
    """The plain-text form, printed under the cell: the straggler first, a fixed-width table
    (past TEXT_ROWS ranks only the slowest, the fastest and the median), the notes, and where
    the traces are."""
    nums = analysis.numbers
    rows = sorted(nums.rows, key=lambda r: r.get("rank", 0))
    lines = [nums.straggler] if nums.straggler else []
    table = [list(HEADERS)]
    if len(rows) > TEXT_ROWS:
        by_time = sorted(rows, key=lambda r: r.get("step_ms") or 0.0)
        pick = {id(r) for r in (by_time[0], *by_time[-2:])}
        pick |= {id(r) for r in rows if r.get("rank") == nums.straggler_rank}
        table += [cells(r) for r in rows if id(r) in pick]
        table.append(["median", *cells(_median(rows))[1:]])
    else:
        table += [cells(r) for r in rows]
    widths = [max(len(r[c]) for r in table) for c in range(len(HEADERS))]
    if rows:
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    else:
        lines.append("no rank left a trace")
    if len(rows) > TEXT_ROWS:
        lines.append(f"{len(table) - 2} of {len(rows)} ranks: the fastest and slowest")
    lines += footer(analysis)
    if directory:
        lines.append(f"traces: {directory}")
    return "\n".join(lines)


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mid(key):
        have = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(have) if have else None

    keys = ("steps", "step_ms", "compute_ms", "comm_ms", "idle_ms", "overlap")
    return {"rank": "median", **{k: mid(k) for k in keys}}
