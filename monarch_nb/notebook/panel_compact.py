"""The live panel for many ranks (COMPACT_RANKS and up): no row per rank, but

- the cell's states as rank sets (``running ranks 0-62 · error rank 63``);
- a heat strip per rank of utilization and one of memory, ranks grouped by host, and under
  them the median and the ranks at either end (``lowest rank 12 (3%)``);
- the loss as one band (lowest to highest of the ranks at each step, and their median), with
  the ranks whose latest loss lies apart from the others' named and drawn as lines of their
  own; utilization and memory over the last minute as bands too.

Its height is fixed, and its size is bounded whatever the number of ranks (MAX_BYTES): past
MAX_CELLS ranks, a strip's cell stands for several. ``parts(view)`` draws it for
``panel_svg.render``; ``text_lines(view)`` is its plain-text form.
"""

from __future__ import annotations

import html
import statistics
from typing import Any

from monarch_nb.dispatch.merging import far_apart
from monarch_nb.dispatch.targets import format_ranks
from monarch_nb.notebook import panel_ft
from monarch_nb.notebook.panel_charts import chart, clip, finite, fmt, text
from monarch_nb.telemetry.figures import GIB, color
from monarch_nb.telemetry.store import thin

COMPACT_RANKS = 16  # from this many ranks the panel is compact; under it, a row per rank
MAX_CELLS = 64  # cells per heat strip; past it a cell is several ranks (their mean, their max)
LOSS_BINS = 120  # spans of steps in the loss band; points of a line apart
HISTORY_BINS = 60  # one per second of the last minute
MAX_APART = 3  # ranks apart from the others drawn as lines of their own
MAX_HOSTS = 16  # hosts named under the strips; past it, how many there are
MAX_BYTES = 40_000  # the picture's size at any number of ranks (tests/notebook/test_widgets.py)
HEIGHT = 330  # below the title; the charts take the last CHART of it (panel_ft.HEIGHT more
# under them on a cluster started with --ft)
CHART = 176
UTIL_COLOR, MEM_COLOR, LOSS_COLOR = "#1f77b4", "#9467bd", "#ff7f0e"
_STRIP_X = 78  # the strips start here, after their labels
_STRIP_H = 16


def parts(view: dict[str, Any], width: int, top: float, states: dict[str, str]) -> list[str]:
    """The compact picture's SVG elements, from ``top`` down; ``states``: a colour per state."""
    rows = view["ranks"]
    out = [_states(rows, top + 14, states)]
    y = top + 26
    cells = _cells(rows)
    out.append(text(0, y + 12, "utilization", 11, fill_opacity="0.75"))
    out.append(_strip(cells, "util", y, width, UTIL_COLOR))
    y += _STRIP_H + 4
    out.append(text(0, y + 12, "memory", 11, fill_opacity="0.75"))
    out.append(_strip(cells, "mem", y, width, MEM_COLOR))
    y += _STRIP_H + 2
    out.extend(_hosts(rows, y, width))
    y += 30
    out.append(text(0, y, clip(_util_line(rows), 140), 11))
    out.append(text(0, y + 16, clip(_mem_line(rows), 140), 11))
    loss, apart = _loss(view)
    out.append(text(0, y + 32, clip(_loss_line(rows, apart), 140), 11))
    charts = top + HEIGHT - CHART
    ft = view.get("ft")
    xr = None
    if ft is not None:
        xr = panel_ft.x_range([x for s in view["loss"] for x in s["steps"]], ft)
    out.append(
        chart(
            (0, charts, 430, CHART - 4),
            [(r, color(r), pts) for r, pts in apart.items()][:MAX_APART],
            xr,
            None,
            None,
            _loss_title(apart),
            "step",
            view.get("no_loss", "no loss yet: monarch_nb.log(step=i, loss=...)"),
            _log_scale(loss),
            bands=[(LOSS_COLOR, loss)] if loss else [],
            marks=panel_ft.marks(ft),
        )
    )
    if ft is not None:
        under = top + HEIGHT
        box = (450, under, width - 450, panel_ft.HEIGHT - 4)
        out += panel_ft.draw((0, under, 430, panel_ft.HEIGHT - 4), box, ft, xr)
    util_of = "GPU" if any(r.get("util_of") == "gpu" for r in rows) else "CPU"
    for x, key, name, ceiling, c in (
        (450, "util", f"{util_of} utilization %", 100.0, UTIL_COLOR),
        (width - 225, "mem", "memory in use, GiB", None, MEM_COLOR),
    ):
        band = _history(view["history"], key)
        out.append(
            chart(
                (x, charts, 225, CHART - 4),
                [],
                (-HISTORY_BINS, 0.0),
                0.0,
                ceiling,
                name,
                "seconds ago",
                "no samples yet",
                bands=[(c, band)] if band else [],
            )
        )
    return out


# -- states and strips ---------------------------------------------------------------------
def _states(rows: list[dict[str, Any]], y: float, colors: dict[str, str]) -> str:
    """``running ranks 0-62 (12.3 s) · error rank 63``, each state in its colour."""
    by: dict[str, list] = {}
    elapsed: dict[str, float] = {}
    for row in rows:
        state = row.get("state") or "idle"
        by.setdefault(state, []).append(row["rank"])
        if finite(row.get("elapsed")):
            elapsed[state] = max(elapsed.get(state, 0.0), row["elapsed"])
    spans = []
    for state, ranks in by.items():
        words = f"{state} {_ranks(ranks)}"
        if state in elapsed:
            words += f" ({elapsed[state]:.1f} s)"
        c = colors.get(state, "#7f7f7f")
        spans.append(f'<tspan fill="{c}" font-weight="600">{html.escape(words)}</tspan>')
    return f'<text x="0" y="{y:.1f}" font-size="12">{" · ".join(spans)}</text>'


def _ranks(ranks: list) -> str:
    ints = [r for r in ranks if isinstance(r, int)]
    named = [str(r) for r in ranks if not isinstance(r, int)]
    return ", ".join(([format_ranks(ints)] if ints else []) + named)


def _fraction(row: dict[str, Any], key: str) -> float | None:
    if key == "util":
        return row["util"] / 100 if finite(row.get("util")) else None
    used, total = row.get("mem_used"), row.get("mem_total")
    return used / total if finite(used) and finite(total) and total else None


def _cells(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rows a strip's cells stand for: one each, or MAX_CELLS runs of neighbours."""
    if len(rows) <= MAX_CELLS:
        return [[row] for row in rows]
    per = -(-len(rows) // MAX_CELLS)
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def _strip(cells: list[list[dict[str, Any]]], key: str, y: float, width: int, c: str) -> str:
    w = (width - _STRIP_X) / max(len(cells), 1)
    out = [f'<g fill="{c}" transform="translate(0,{y:.0f})">']
    for i, group in enumerate(cells):
        fracs = [f for f in (_fraction(row, key) for row in group) if f is not None]
        # a cell of several ranks: their mean utilization, their fullest memory
        frac = None if not fracs else max(fracs) if key == "mem" else sum(fracs) / len(fracs)
        shade = (
            f'fill-opacity="{0.08 + 0.92 * min(max(frac, 0.0), 1.0):.2f}"'
            if frac is not None
            else 'fill="currentColor" fill-opacity="0.06"'
        )
        title = html.escape(_cell_title(group, key))
        out.append(
            f'<rect x="{_STRIP_X + i * w:.1f}" width="{max(w - 1, 0.5):.1f}" '
            f'height="{_STRIP_H}" {shade}><title>{title}</title></rect>'
        )
    return "".join(out) + "</g>"


def _cell_title(group: list[dict[str, Any]], key: str) -> str:
    names = _ranks([row["rank"] for row in group])
    if key == "util":
        util = [row["util"] for row in group if finite(row.get("util"))]
        what = f"{min(util):.0f}-{max(util):.0f}%" if len(util) > 1 else _pct(group[0])
        return f"{names}: {what}"
    return f"{names}: {_mem(max(group, key=lambda r: _fraction(r, 'mem') or 0.0))}"


def _hosts(rows: list[dict[str, Any]], y: float, width: int) -> list[str]:
    """Under the strips: each host's name under its ranks, a tick between hosts; past
    MAX_HOSTS hosts, how many there are."""
    runs: list[tuple[str, int, int]] = []  # (host, first row, last row)
    for i, row in enumerate(rows):
        host = row.get("host") or "?"
        if runs and runs[-1][0] == host:
            runs[-1] = (host, runs[-1][1], i)
        else:
            runs.append((host, i, i))
    if len(runs) > MAX_HOSTS:
        hosts = len({host for host, _, _ in runs})
        return [text(_STRIP_X, y + 12, f"{hosts} hosts", 10, fill_opacity="0.7")]
    w = (width - _STRIP_X) / max(len(rows), 1)
    out = []
    for k, (host, first, last) in enumerate(runs):
        x0, x1 = _STRIP_X + first * w, _STRIP_X + (last + 1) * w
        if k:
            out.append(
                f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{y - 2 * _STRIP_H - 6:.1f}" '
                f'y2="{y + 4:.1f}" stroke="currentColor" stroke-opacity="0.5"/>'
            )
        n = last - first + 1
        label = f"{host} · {n} rank{'s' if n != 1 else ''}"
        chars = max(int((x1 - x0) / 6.5), 1)
        if len(label) > chars:  # too narrow for the count (16 hosts of 64): the name alone
            label = host
        mid = (x0 + x1) / 2
        out.append(text(mid, y + 12, clip(label, chars), 10, "middle", fill_opacity="0.7"))
    return out


# -- the lines of numbers ------------------------------------------------------------------
def _pct(row: dict[str, Any]) -> str:
    return f"{row['util']:.0f}%" if finite(row.get("util")) else "–"


def _mem(row: dict[str, Any]) -> str:
    used, total = row.get("mem_used"), row.get("mem_total")
    if not finite(used):
        return "–"
    return f"{used / GIB:.1f}/{total / GIB:.0f} GiB" if finite(total) else f"{used / GIB:.1f} GiB"


def _util_line(rows: list[dict[str, Any]]) -> str:
    have = [r for r in rows if finite(r.get("util"))]
    if not have:
        return "utilization: no samples yet"
    what = "GPU" if any(r.get("util_of") == "gpu" for r in have) else "CPU"
    low = min(have, key=lambda r: r["util"])
    high = max(have, key=lambda r: r["util"])
    median = statistics.median(r["util"] for r in have)
    return (
        f"{what} utilization: median {median:.0f}% · lowest rank {low['rank']} ({_pct(low)})"
        f" · highest rank {high['rank']} ({_pct(high)})"
    )


def _mem_line(rows: list[dict[str, Any]]) -> str:
    have = [r for r in rows if finite(r.get("mem_used"))]
    if not have:
        return "memory: no samples yet"
    high = max(have, key=lambda r: _fraction(r, "mem") or r["mem_used"])
    median = statistics.median(r["mem_used"] for r in have) / GIB
    return f"memory: median {median:.1f} GiB · fullest rank {high['rank']} ({_mem(high)})"


def _loss_line(rows: list[dict[str, Any]], apart: dict[Any, list]) -> str:
    latest = {r["rank"]: r["loss"] for r in rows if finite(r.get("loss"))}
    bad = [r["rank"] for r in rows if r.get("loss_bad")]
    if not latest and not bad:
        return "loss: none logged yet"
    parts = []
    if latest:
        parts.append(f"loss: median {fmt(statistics.median(latest.values()))}")
    if apart:
        shown = list(apart.items())[:MAX_APART]
        far = ", ".join(f"rank {r} ({fmt(pts[-1][1])})" for r, pts in shown)
        more = len(apart) - MAX_APART
        parts.append(f"apart from the others: {far}" + (f" and {more} more" if more > 0 else ""))
    if bad:
        parts.append(f"not finite: {_ranks(bad)}")
    return " · ".join(parts)


# -- bands -----------------------------------------------------------------------------------
def _loss(view: dict[str, Any]) -> tuple[list[tuple[float, ...]], dict[Any, list]]:
    """The loss band over the steps, and the ranks apart from the others (by their latest
    loss) with their own points."""
    series = {s["rank"]: s for s in view["loss"]}
    latest = {
        rank: s["values"][-1]
        for rank, s in series.items()
        if s["values"] and finite(s["values"][-1])
    }
    apart = {}
    for rank in sorted(far_apart(latest), key=lambda r: -abs(latest[r])):
        pts = list(zip(series[rank]["steps"], series[rank]["values"], strict=False))
        apart[rank] = thin(pts, LOSS_BINS)
    points = [
        (x, y)
        for rank, s in series.items()
        if rank not in apart  # drawn on their own
        for x, y in zip(s["steps"], s["values"], strict=False)
        if finite(x) and finite(y)
    ]
    return _band(points, LOSS_BINS), apart


def _loss_title(apart: dict[Any, list]) -> str:
    if not apart:
        return "loss of the ranks: lowest, median, highest"
    shown = list(apart)[:MAX_APART]
    return f"loss: the others' band, and {_ranks(shown)} apart"


def _history(history: list[dict[str, Any]], key: str) -> list[tuple[float, ...]]:
    points = [
        (t, v)
        for h in history
        for t, v in zip(h["t"], h[key], strict=False)
        if finite(t) and finite(v)
    ]
    return _band(points, HISTORY_BINS)


def _band(points: list[tuple[float, float]], bins: int) -> list[tuple[float, ...]]:
    """``(x, lowest, median, highest)`` of the points in each of ``bins`` equal spans of x."""
    if not points:
        return []
    x0 = min(x for x, _ in points)
    x1 = max(x for x, _ in points)
    span = (x1 - x0) / bins or 1.0
    by: dict[int, list] = {}
    for x, y in points:
        by.setdefault(min(int((x - x0) / span), bins - 1), []).append((x, y))
    out = []
    for k in sorted(by):
        ys = sorted(y for _, y in by[k])
        xs = [x for x, _ in by[k]]
        out.append((sum(xs) / len(xs), ys[0], statistics.median(ys), ys[-1]))
    return out


def _log_scale(band: list[tuple[float, ...]]) -> bool:
    lows = [p[1] for p in band]
    highs = [p[3] for p in band]
    return bool(band) and min(lows) > 0 and max(highs) / min(lows) >= 100


def text_lines(view: dict[str, Any]) -> list[str]:
    """The compact form as plain text: states, utilization, memory and loss in four lines."""
    rows = view["ranks"]
    by: dict[str, list] = {}
    for row in rows:
        by.setdefault(row.get("state") or "idle", []).append(row["rank"])
    _, apart = _loss(view)
    return [
        " · ".join(f"{state} {_ranks(ranks)}" for state, ranks in by.items()),
        _util_line(rows),
        _mem_line(rows),
        _loss_line(rows, apart),
    ]
