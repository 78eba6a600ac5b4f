"""The live panel's picture: one fixed-size inline SVG, drawn in Python, no JavaScript.

The same ``render(view)`` draws the live view (the value of an ``ipywidgets.HTML``), the frozen
snapshot a saved notebook keeps, and the static fallback where widgets cannot run. A view::

    view = panel_view(ctl.metrics.store.snapshot(points=400, samples=120), states)

has a row per rank (device, state, utilization, memory, step, loss), the loss per rank
against the step, and each rank's recent utilization and memory samples. The picture's size
depends only on the number of ranks, so an update never moves the page; text uses
``currentColor``, so it reads on light and dark themes; colours per rank are the sidebar's
(``figures.color``); only presentation attributes are used, no ``<style>`` or script.
"""

from __future__ import annotations

import html
import math
import time
from typing import Any

from monarch_nb.telemetry.figures import GIB, color, rank_view
from monarch_nb.telemetry.store import thin

WIDTH = 900
HISTORY_S = 60.0  # seconds of utilization and memory history drawn
MAX_POINTS = 400  # points per line; more are evenly thinned, the newest kept
MAX_ROWS = 32  # rank rows drawn; the rest are counted in one line
STATE_COLORS = {
    "running": "#1f77b4",
    "done": "#2ca02c",
    "error": "#d62728",
    "lost": "#d62728",
    "cancelled": "#7f7f7f",
    "queued": "#7f7f7f",
    "idle": "#7f7f7f",
    "up": "#2ca02c",
    "down": "#7f7f7f",
}
_FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
_HEAD = 26  # the title line
_CHART = 176  # the three charts under the rank rows
_GRID = 'stroke="currentColor" stroke-opacity="0.12"'


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def panel_view(
    snapshot: dict[str, Any],
    states: dict[Any, tuple[str, float | None]] | None = None,
    ranks: list | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The picture's data from a metrics snapshot (``Store.snapshot``) and the cell's
    ``rank -> (state, seconds running)``; ``ranks`` adds rows for ranks that logged nothing."""
    states = states or {}
    now = time.time() if now is None else now
    base = rank_view({"workers": [], "metrics": snapshot})
    rows = {row["rank"]: row for row in base["ranks"]}
    for rank in list(ranks or []) + list(states):
        rows.setdefault(rank, {"rank": rank, "util_of": "cpu"})
    logged = {e.get("rank"): e for e in snapshot.get("ranks") or []}
    out_rows, history = [], []
    for rank in sorted(rows, key=_order):
        row = dict(rows[rank])
        state, elapsed = states.get(rank, ("idle", None))
        row["state"], row["elapsed"] = state, elapsed
        entry = logged.get(rank) or {}
        # a None latest loss after steps were logged is a non-finite one (JSON has no NaN)
        values = entry.get("values") or {}
        row["loss_bad"] = "loss" in values and values["loss"] is None
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
    return {"now": now, "ranks": out_rows, "loss": loss, "history": history}


def _order(rank: Any) -> tuple:
    return (0, rank, "") if isinstance(rank, int) else (1, 0, str(rank))


# -- scales and ticks ------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round ticks (1, 2, 5 times a power of ten) covering [lo, hi]; the first and last
    are the axis's ends."""
    if not (_finite(lo) and _finite(hi)):
        lo, hi = 0.0, 1.0
    if hi - lo <= abs(hi) * 1e-9 or hi <= lo:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(count - 1, 1)
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * step >= raw:
            step *= m
            break
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(first, last + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return [10.0**e for e in range(first, last + 1)]


def fmt(v: float | None) -> str:
    """A short number: 0.0123, 1.23e-05, 12.3k."""
    if v is None or not _finite(v):
        return "–"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e5:
        for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if a >= size:
                return f"{v / size:.3g}{unit}"
    if a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _power(v: float) -> str:
    e = round(math.log10(v))
    return fmt(v) if -3 <= e <= 4 else f"1e{e}"


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _t(x: float, y: float, text: str, size: int = 11, anchor: str = "start", **extra) -> str:
    extra.setdefault("fill", "currentColor")
    attrs = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in extra.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{attrs}>'
        f"{html.escape(text)}</text>"
    )


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
    if step is not None:
        loss_text = f"step {step} · {loss_text}" if loss_text else f"step {step}"
    parts.append(_t(WIDTH - 2, mid + 4, _clip(loss_text, 30), 11, "end"))
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
) -> str:
    """A line chart in ``box`` (x, y, w, h): axes with ticks, one polyline per rank, a dot on
    each line's newest point. Non-finite points are left out; None on an axis means "fit"."""
    bx, by, bw, bh = box
    left, bottom, top = 46, 30, 18
    px, py, pw, ph = bx + left, by + top, bw - left - 8, bh - top - bottom
    clean = []
    for rank, xs, ys in series:
        pts = [(x, y) for x, y in zip(xs, ys, strict=False) if _finite(x) and _finite(y)]
        if log_y:
            pts = [(x, y) for x, y in pts if y > 0]
        if pts:
            clean.append((rank, thin(pts, MAX_POINTS)))
    out = [_t(bx, by + 11, title, 11, font_weight="600")]
    out.append(
        f'<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="currentColor" '
        'stroke-opacity="0.25"/>'
    )
    if not clean:
        out.append(_t(px + pw / 2, py + ph / 2 + 4, empty, 11, "middle", fill_opacity="0.6"))
        return "".join(out)
    xs = [x for _, pts in clean for x, _ in pts]
    ys = [y for _, pts in clean for _, y in pts]
    x0, x1 = x_range or (min(xs), max(xs))
    if x1 <= x0:
        x1 = x0 + 1
    lo = min(ys) if y_floor is None else min(y_floor, min(ys))
    hi = max(ys) if y_ceiling is None else max(y_ceiling, max(ys))
    if log_y:
        yticks = _log_ticks(lo, hi)
        fy = math.log10
    else:
        yticks = nice_ticks(lo, hi)
        fy = float
    y0, y1 = fy(yticks[0]), fy(yticks[-1])
    if y1 <= y0:
        y1 = y0 + 1

    def sx(x: float) -> float:
        return px + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return py + ph - (fy(y) - y0) / (y1 - y0) * ph

    for tick in yticks:
        ty = sy(tick)
        label = _power(tick) if log_y else fmt(tick)
        out.append(f'<line x1="{px}" x2="{px + pw}" y1="{ty:.1f}" y2="{ty:.1f}" {_GRID}/>')
        out.append(_t(px - 4, ty + 3.5, label, 10, "end", fill_opacity="0.75"))
    xticks = [t for t in nice_ticks(x0, x1, 5) if x0 - 1e-9 <= t <= x1 + 1e-9]
    for tick in xticks:
        tx = sx(tick)
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{py}" y2="{py + ph}" {_GRID}/>')
        out.append(_t(tx, py + ph + 13, fmt(tick), 10, "middle", fill_opacity="0.75"))
    out.append(_t(px + pw / 2, py + ph + 26, x_label, 10, "middle", fill_opacity="0.75"))
    for rank, pts in clean:
        c = color(rank)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline points="{coords}" fill="none" stroke="{c}" stroke-width="1.8" '
            f'stroke-linejoin="round" data-rank="{html.escape(str(rank))}"/>'
        )
        lx, ly = pts[-1]
        out.append(f'<circle cx="{sx(lx):.1f}" cy="{sy(ly):.1f}" r="2.6" fill="{c}"/>')
    return "".join(out)


def height(n_ranks: int) -> int:
    """The picture's height in pixels: it depends on the number of ranks only."""
    shown = min(n_ranks, MAX_ROWS)
    rows = shown * (30 if n_ranks <= 8 else 20) + (18 if n_ranks > MAX_ROWS else 0)
    return _HEAD + max(rows, 20) + 10 + _CHART


def render(view: dict[str, Any], title: str, subtitle: str = "", note: str = "") -> str:
    """The panel as HTML: a fixed-size ``<svg>``, and ``note`` as a line of text under it."""
    ranks = view["ranks"]
    h = height(len(ranks))
    tall = len(ranks) <= 8
    row_h = 30 if tall else 20
    parts = [_t(0, 16, _clip(title, 60), 13, font_weight="700")]
    stamp = time.strftime("%H:%M:%S", time.localtime(view["now"]))
    right = f"{subtitle} · {stamp}" if subtitle else stamp
    parts.append(_t(WIDTH, 16, _clip(right, 80), 11, "end", fill_opacity="0.7"))
    y = _HEAD
    if not ranks:
        parts.append(_t(10, y + 14, "no ranks yet", 11, fill_opacity="0.6"))
    for row in ranks[:MAX_ROWS]:
        parts.append(_row(row, y, tall))
        y += row_h
    if len(ranks) > MAX_ROWS:
        more = len(ranks) - MAX_ROWS
        parts.append(
            _t(10, y + 13, f"+{more} more ranks (the sidebar and %monarch status list all)", 11)
        )
    top = h - _CHART
    parts.append(f'<line x1="0" x2="{WIDTH}" y1="{top - 5}" y2="{top - 5}" {_GRID}/>')
    loss = view["loss"]
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
            None,
            None,
            None,
            loss_title,
            "step",
            "no loss yet: monarch_nb.log(step=i, loss=...)",
            log_y,
        )
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
    # as wide as the output area up to its own width; the height follows the fixed aspect
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="-2 0 {WIDTH + 4} {h}" '
        f'font-family="{_FONT}" class="monarch-panel-svg" style="display:block">'
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
        if row.get("step") is not None:
            parts.append(f"step {row['step']}")
        if _finite(row.get("loss")):
            parts.append(f"loss {fmt(row['loss'])}")
        lines.append("  ".join(parts))
    return "\n".join(lines)
