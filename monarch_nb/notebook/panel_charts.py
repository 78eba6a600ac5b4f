"""The live panel's drawing parts (panel_svg.py's per-rank view, panel_compact.py's view of
many ranks): numbers and ticks, text, and a line chart with axes, whose lines are either one per
rank or a band (lowest to highest, and the median) over many ranks."""

from __future__ import annotations

import html
import math
from typing import Any

from monarch_nb.telemetry.store import thin

MAX_POINTS = 400  # points per line; more are evenly thinned, the newest kept
FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
GRID = 'stroke="currentColor" stroke-opacity="0.12"'
MAX_MARK_LABELS = 3  # marks on a chart that are labelled; past it, their titles say


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# -- scales and ticks ------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round ticks (1, 2, 5 times a power of ten) covering [lo, hi]; the first and last
    are the axis's ends."""
    if not (finite(lo) and finite(hi)):
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


def log_ticks(lo: float, hi: float) -> list[float]:
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return [10.0**e for e in range(first, last + 1)]


def fmt(v: float | None) -> str:
    """A short number: 0.0123, 1.23e-05, 12.3k."""
    if v is None or not finite(v):
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


def power(v: float) -> str:
    e = round(math.log10(v))
    return fmt(v) if -3 <= e <= 4 else f"1e{e}"


def clip(words: str, chars: int) -> str:
    return words if len(words) <= chars else words[: chars - 1] + "…"


def text(x: float, y: float, words: str, size: int = 11, anchor: str = "start", **extra) -> str:
    extra.setdefault("fill", "currentColor")
    attrs = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in extra.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{attrs}>'
        f"{html.escape(words)}</text>"
    )


# -- a chart -------------------------------------------------------------------------------------
Points = list[tuple[float, float]]
Band = list[tuple[float, float, float, float]]  # (x, lowest, median, highest)


def chart(
    box: tuple[float, float, float, float],
    lines: list[tuple[Any, str, Points]],
    x_range: tuple[float, float] | None,
    y_floor: float | None,
    y_ceiling: float | None,
    title: str,
    x_label: str,
    empty: str,
    log_y: bool = False,
    bands: list[tuple[str, Band]] = (),
    marks: list[tuple[float, str, str]] = (),
) -> str:
    """A chart in ``box`` (x, y, w, h): axes with ticks; ``lines`` as ``(key, colour,
    points)``, each a polyline (``data-rank`` = key) with a dot on its newest point; ``bands``
    as ``(colour, [(x, lowest, median, highest)])``, each a shaded area and its median's line;
    ``marks`` as ``(x, colour, words)``, each a thin dashed vertical line (a rank lost at that
    step), labelled with ``words`` where few. Non-finite points are left out; None on an axis
    means "fit"."""
    bx, by, bw, bh = box
    left, bottom, top = 46, 30, 18
    px, py, pw, ph = bx + left, by + top, bw - left - 8, bh - top - bottom
    clean, shaded = [], []
    for key, c, pts in lines:
        pts = [(x, y) for x, y in pts if finite(x) and finite(y) and (y > 0 or not log_y)]
        if pts:
            clean.append((key, c, thin(pts, MAX_POINTS)))
    for c, band in bands:
        band = [p for p in band if all(map(finite, p)) and (p[1] > 0 or not log_y)]
        if band:
            shaded.append((c, thin(band, MAX_POINTS)))
    out = [text(bx, by + 11, title, 11, font_weight="600")]
    out.append(
        f'<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="currentColor" '
        'stroke-opacity="0.25"/>'
    )
    if not clean and not shaded:
        out.append(text(px + pw / 2, py + ph / 2 + 4, empty, 11, "middle", fill_opacity="0.6"))
        return "".join(out)
    xs = [x for _, _, pts in clean for x, _ in pts] + [p[0] for _, b in shaded for p in b]
    ys = [y for _, _, pts in clean for _, y in pts]
    ys += [y for _, b in shaded for p in b for y in (p[1], p[3])]
    x0, x1 = x_range or (min(xs), max(xs))
    if x1 <= x0:
        x1 = x0 + 1
    lo = min(ys) if y_floor is None else min(y_floor, min(ys))
    hi = max(ys) if y_ceiling is None else max(y_ceiling, max(ys))
    if log_y:
        yticks = log_ticks(lo, hi)
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
        label = power(tick) if log_y else fmt(tick)
        out.append(f'<line x1="{px}" x2="{px + pw}" y1="{ty:.1f}" y2="{ty:.1f}" {GRID}/>')
        out.append(text(px - 4, ty + 3.5, label, 10, "end", fill_opacity="0.75"))
    xticks = [t for t in nice_ticks(x0, x1, 5) if x0 - 1e-9 <= t <= x1 + 1e-9]
    for tick in xticks:
        tx = sx(tick)
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{py}" y2="{py + ph}" {GRID}/>')
        out.append(text(tx, py + ph + 13, fmt(tick), 10, "middle", fill_opacity="0.75"))
    out.append(text(px + pw / 2, py + ph + 26, x_label, 10, "middle", fill_opacity="0.75"))
    shown = [m for m in marks if finite(m[0]) and x0 <= m[0] <= x1]
    for x, c, words in shown:
        mx = sx(x)
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{py}" y2="{py + ph}" stroke="{c}" '
            f'stroke-opacity="0.75" stroke-dasharray="3 2" class="ft-mark">'
            f"<title>{html.escape(words)}</title></line>"
        )
        if len(shown) <= MAX_MARK_LABELS:
            out.append(text(mx + 3, py + 10, clip(words, 18), 9, fill=c))
    for c, band in shaded:
        # the area: along the highest values, back along the lowest
        edge = [(p[0], p[3]) for p in band] + [(p[0], p[1]) for p in reversed(band)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in edge)
        out.append(f'<polygon points="{coords}" fill="{c}" fill-opacity="0.22" stroke="none"/>')
        mid = " ".join(f"{sx(p[0]):.1f},{sy(p[2]):.1f}" for p in band)
        out.append(
            f'<polyline points="{mid}" fill="none" stroke="{c}" stroke-width="1.8" '
            'stroke-linejoin="round" class="median"/>'
        )
    for key, c, pts in clean:
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(
            f'<polyline points="{coords}" fill="none" stroke="{c}" stroke-width="1.8" '
            f'stroke-linejoin="round" data-rank="{html.escape(str(key))}"/>'
        )
        lx, ly = pts[-1]
        out.append(f'<circle cx="{sx(lx):.1f}" cy="{sy(ly):.1f}" r="2.6" fill="{c}"/>')
    return "".join(out)
