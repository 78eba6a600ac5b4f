"""The live panel on a cluster started with ``--ft``: each rank's way out of a fault-tolerant
cell and back (lost, joining, healing, back at step N), a dashed mark on the loss chart at each
step where a rank was lost, and under the loss chart the participants per step (a step chart
on the loss chart's x axis, 0 to the world size, the steps with fewer shaded) beside the newest
events. Drawn from ``telemetry/ft_feed.py``'s ``feed``, which the sidebar gets too; on other
clusters there is no feed and the panel is as it was."""

from __future__ import annotations

import itertools
import time
from typing import Any

from monarch_nb.notebook.panel_charts import GRID, clip, finite, fmt, nice_ticks, text
from monarch_nb.telemetry import ft_feed

HEIGHT = 72  # added under the charts on an ft cluster
LOST_COLOR = "#d62728"
LINE_COLOR = "#17becf"
EVENTS_SHOWN = 4  # a loss's four: lost, joining, healing, back
_LEFT, _RIGHT = 46, 8  # the plot's margins in its box: the loss chart's (panel_charts.chart)


def _live(req) -> list[int]:
    """The ranks still in the cell: not reported done (an away rank stays in ``remaining``)."""
    return [r for r in req.ranks if r in req.remaining and req.status.get(r) is None]


def feed(ctl, req, now: float) -> dict[str, Any] | None:
    """The ft picture of ``req``'s cell (or of the whole cluster without one); None without
    ``--ft``."""
    if req is None:
        return ft_feed.feed(ctl, now=now)
    return ft_feed.feed(ctl, since=req.t0, live=_live(req), now=now)


def away(ctl, req) -> dict[int, str]:
    """rank -> "lost" / "joining" / "healing": the cell's ranks away now."""
    if req is None or getattr(ctl, "ft", None) is None:
        return {}
    out, _ = ft_feed.away(ft_feed.cell_events(ctl, req.t0), _live(req))
    return {a["rank"]: a["state"] for a in out}


def notes(ft: dict[str, Any] | None) -> dict[Any, str]:
    """rank -> what its row says of it: ``lost at step 57``, ``back at step 71`` ..."""
    if not ft:
        return {}
    out = {}
    for a in ft.get("away") or []:
        step = a.get("step")
        at = f" at step {step}" if step is not None else ""
        out[a["rank"]] = {
            "lost": f"lost{at}",
            "joining": "joining: setup cells",
            "healing": f"healing from a peer{at}",
        }.get(a["state"], a["state"])
    for b in ft.get("back") or []:
        out[b["rank"]] = f"back at step {b['step']}" if b.get("step") is not None else "back"
    return out


def x_range(xs: list, ft: dict[str, Any] | None) -> tuple[float, float] | None:
    """The steps both charts share: the loss's and the participants'."""
    xs = [x for x in xs if finite(x)]
    xs += [p[0] for p in (ft or {}).get("participants") or []]
    if not xs:
        return None
    x0, x1 = min(xs), max(xs)
    return (x0, x1) if x1 > x0 else (x0, x0 + 1)


def marks(ft: dict[str, Any] | None) -> list[tuple[float, str, str]]:
    """A mark on the loss chart at each step where a rank was lost."""
    return [(step, LOST_COLOR, f"rank {rank} lost") for step, rank in (ft or {}).get("lost", [])]


def _event(e: dict[str, Any], world: int) -> str:
    rank, step, n = e.get("rank"), e.get("step"), e.get("participants")
    what = {
        "lost": f"rank {rank} lost at step {step}" + (f"; {n} of {world} go on" if n else ""),
        "joining": f"rank {rank} joining: its replacement runs the setup cells",
        "healing": f"rank {rank} healing from a peer at step {step}",
        "back": f"rank {rank} back at step {step}" + (f"; {n} of {world} train" if n else ""),
    }.get(e.get("event"), f"rank {rank} {e.get('event')}")
    stamp = time.strftime("%H:%M:%S", time.localtime(e["time"])) if finite(e.get("time")) else ""
    return f"{stamp}  {what}" if stamp else what


def latest(ft: dict[str, Any]) -> str:
    points = ft.get("participants") or []
    if not points:
        return ""
    step, n = points[-1]
    return f"{n} of {ft['world']} at step {step}"


def draw(
    box: tuple[float, float, float, float],
    events_box: tuple[float, float, float, float],
    ft: dict[str, Any],
    xr: tuple[float, float] | None,
) -> list[str]:
    """The participants per step in ``box`` (its plot under the loss chart's, on ``xr``), and
    the newest events in ``events_box``."""
    bx, by, bw, bh = box
    px, py, pw, ph = bx + _LEFT, by + 18, bw - _LEFT - _RIGHT, bh - 18 - 16
    world = max(int(ft.get("world") or 1), 1)
    points = ft.get("participants") or []
    out = [text(bx, by + 11, "participants per step", 11, font_weight="600")]
    out.append(text(bx + bw - _RIGHT, by + 11, latest(ft), 10, "end", fill_opacity="0.75"))
    out.append(
        f'<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="currentColor" '
        'stroke-opacity="0.25"/>'
    )
    for n, y in ((world, py), (0, py + ph)):
        out.append(text(px - 4, y + 3.5, str(n), 10, "end", fill_opacity="0.75"))
    if not points or xr is None:
        words = "no ft.steps loop yet"
        out.append(text(px + pw / 2, py + ph / 2 + 4, words, 11, "middle", fill_opacity="0.6"))
        return out + _events(events_box, ft)
    x0, x1 = xr

    def sx(x: float) -> float:
        return px + (min(max(x, x0), x1) - x0) / (x1 - x0) * pw

    def sy(n: float) -> float:
        return py + ph - min(max(n, 0), world) / world * ph

    for tick in [t for t in nice_ticks(x0, x1, 5) if x0 - 1e-9 <= t <= x1 + 1e-9]:
        tx = sx(tick)
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{py}" y2="{py + ph}" {GRID}/>')
        out.append(text(tx, py + ph + 12, fmt(tick), 10, "middle", fill_opacity="0.75"))
    # the steps taken with fewer than every rank, shaded over the plot's height
    for (a, n), (b, _) in itertools.pairwise(points):
        if n < world:
            out.append(
                f'<rect x="{sx(a):.1f}" y="{py}" width="{max(sx(b) - sx(a), 1.0):.1f}" '
                f'height="{ph}" fill="{LOST_COLOR}" fill-opacity="0.14" class="ft-fewer"/>'
            )
    path = f"M{sx(points[0][0]):.1f},{sy(points[0][1]):.1f}"
    for step, n in points[1:]:
        path += f" H{sx(step):.1f} V{sy(n):.1f}"
    out.append(
        f'<path d="{path}" fill="none" stroke="{LINE_COLOR}" stroke-width="1.8" '
        'class="ft-participants"/>'
    )
    return out + _events(events_box, ft)


def _events(box: tuple[float, float, float, float], ft: dict[str, Any]) -> list[str]:
    bx, by, bw, _ = box
    out = [text(bx, by + 11, "fault tolerance", 11, font_weight="600")]
    events = (ft.get("events") or [])[-EVENTS_SHOWN:]
    if not events:
        words = "no rank lost yet"
        return [*out, text(bx, by + 26, words, 11, fill_opacity="0.6")]
    chars = int(bw / 6.2)
    for i, e in enumerate(events):
        c = LOST_COLOR if e.get("event") == "lost" else "currentColor"
        out.append(text(bx, by + 26 + 13 * i, clip(_event(e, ft["world"]), chars), 11, fill=c))
    return out


def text_line(ft: dict[str, Any] | None) -> str:
    """The plain-text form: participants now, and the newest event."""
    if not ft:
        return ""
    parts = [f"participants: {latest(ft)}" if latest(ft) else "participants: no ft.steps yet"]
    if ft.get("events"):
        parts.append(_event({**ft["events"][-1], "time": None}, ft["world"]))
    return " · ".join(parts)
