"""The cluster's figures, shared by the scheduler's ``/monarch`` page and the notebook panel.

Two layers: ``rank_view`` turns the JSON of ``/monarch/metrics.json`` (the workers as the
scheduler sees them plus ``metrics_store.metrics_snapshot``) into one row per rank and one loss
series per rank, in plain Python (the Jupyter server sends the same view to the sidebar); the
bokeh functions draw that view from ``ColumnDataSource``s, so a caller updates the data in
place (``source.data = bar_columns(view)``) and never redraws.

On the controller, where there is no HTTP round trip, the same view comes from the hub::

    view = rank_view({"workers": [], "metrics": ctl.metrics.store.snapshot()})
"""

from __future__ import annotations

from typing import Any

LOSS = "loss"  # the scalar the loss chart plots
PALETTE = (  # Category10: one colour per rank, repeating past ten
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
GIB = 2**30


def color(rank: Any) -> str:
    return PALETTE[rank % len(PALETTE)] if isinstance(rank, int) else PALETTE[-1]


def _rank_of(worker: dict[str, Any], position: int) -> Any:
    name = worker.get("name")
    if isinstance(name, int):
        return name
    if isinstance(name, str) and name.isdigit():
        return int(name)
    return f"worker {name}" if name is not None else position


def _order(rank: Any) -> tuple:
    return (0, rank, "") if isinstance(rank, int) else (1, 0, str(rank))


def labels_text(labels: dict[str, Any] | None) -> str:
    """``dp=1 tp=0 stage=embed``: a rank's mesh coordinates and ``label()``s, as every view
    writes them."""
    return " ".join(f"{k}={v}" for k, v in (labels or {}).items())


def rank_view(payload: dict[str, Any], scalar: str = LOSS) -> dict[str, Any]:
    """``{"time", "ranks": [row per rank], "loss": [{"rank", "steps", "values"}]}``, and on a
    cluster started with ``--ft`` its ``ft`` feed (ft_feed.py), whose ranks away (lost,
    joining, healing) have that as their status.

    A row: rank, worker, host, status, device, kind, util (%, the GPU's, or the worker
    process's CPU on a CPU worker: ``util_of`` says which), mem_used / mem_total (bytes),
    step, the latest ``scalar`` and the rank's labels (``dp=1 tp=0 stage=embed``).
    """
    metrics = payload.get("metrics") or {}
    by_rank: dict[Any, dict[str, Any]] = {}
    by_worker: dict[str, Any] = {}
    for position, w in enumerate(payload.get("workers") or []):
        rank = _rank_of(w, position)
        by_worker[str(w.get("name"))] = rank
        mem_total = w.get("memory_limit") or None
        by_rank[rank] = {
            "rank": rank,
            "worker": str(w.get("name")),
            "host": w.get("host"),
            "status": w.get("status") or "unknown",
            "device": None,
            "kind": None,
            "util": w.get("cpu"),
            "util_of": "cpu",
            "mem_used": w.get("memory"),
            "mem_total": mem_total,
            "step": None,
            scalar: None,
            "labels": "",
        }
    loss = []
    for entry in metrics.get("ranks") or []:
        rank = entry.get("rank")
        if rank is None:
            rank = by_worker.get(str(entry.get("worker")), f"worker {entry.get('worker')}")
        row = by_rank.setdefault(
            rank,
            {"rank": rank, "worker": entry.get("worker"), "status": "gone", "util_of": "cpu"},
        )
        row["host"] = entry.get("host") or row.get("host")
        row["labels"] = labels_text(entry.get("labels"))
        row["step"] = entry.get("step")
        row[scalar] = (entry.get("values") or {}).get(scalar)
        sample = entry.get("sample") or {}
        if sample:
            row["device"] = sample.get("device")
            row["kind"] = sample.get("kind")
            if sample.get("util") is not None:
                row["util"], row["util_of"] = sample["util"], "gpu"
            elif sample.get("cpu") is not None:
                row["util"], row["util_of"] = sample["cpu"], "cpu"
            if sample.get("mem_used") is not None:
                row["mem_used"], row["mem_total"] = sample["mem_used"], sample.get("mem_total")
        points = [
            (step, values[scalar])
            for step, _, values in entry.get("scalars") or []
            if values.get(scalar) is not None
        ]
        if points:
            loss.append(
                {"rank": rank, "steps": [s for s, _ in points], "values": [v for _, v in points]}
            )
    ranks = sorted(by_rank.values(), key=lambda r: _order(r["rank"]))
    view = {"time": payload.get("time"), "ranks": ranks, "loss": loss}
    ft = metrics.get("ft")
    if isinstance(ft, dict):  # a cluster started with --ft: who is away now, participants
        view["ft"] = ft
        away = {a.get("rank"): a.get("state") for a in ft.get("away") or []}
        for row in ranks:
            if away.get(row["rank"]):
                row["status"] = away[row["rank"]]
    return view


def _label(row: dict[str, Any]) -> str:
    parts = [f"rank {row['rank']}" if isinstance(row["rank"], int) else str(row["rank"])]
    parts.append(row.get("labels") or "")
    parts.append(row.get("device") or row.get("kind") or "")
    parts.append(row.get("host") or "")
    return " · ".join(p for p in parts if p)


def bar_columns(view: dict[str, Any]) -> dict[str, list]:
    """One bar per rank: y (position), utilization and memory in %, and their labels."""
    cols: dict[str, list] = {
        k: []
        for k in ("y", "rank", "label", "util", "util_text", "mem", "mem_text", "color", "status")
    }
    for y, row in enumerate(view["ranks"]):
        util = row.get("util")
        used, total = row.get("mem_used"), row.get("mem_total")
        mem = 100.0 * used / total if used is not None and total else None
        what = "GPU" if row.get("util_of") == "gpu" else "CPU"
        cols["y"].append(y)
        cols["rank"].append(str(row["rank"]))
        cols["label"].append(_label(row))
        cols["util"].append(min(float(util), 100.0) if util is not None else 0.0)
        cols["util_text"].append(f"{what} {util:.0f}%" if util is not None else f"{what} -")
        cols["mem"].append(mem if mem is not None else 0.0)
        cols["mem_text"].append(
            f"{used / GIB:.1f} / {total / GIB:.1f} GiB" if mem is not None else "-"
        )
        cols["color"].append(color(row["rank"]))
        cols["status"].append(row.get("status") or "unknown")
    return cols


def loss_columns(view: dict[str, Any]) -> dict[str, list]:
    """One line per rank for bokeh's multi_line."""
    series = view["loss"]
    return {
        "xs": [s["steps"] for s in series],
        "ys": [s["values"] for s in series],
        "rank": [str(s["rank"]) for s in series],
        "color": [color(s["rank"]) for s in series],
    }


def _bars(source, value: str, text: str, title: str):
    from bokeh.models import HoverTool, Range1d
    from bokeh.plotting import figure

    fig = figure(
        title=title,
        height=220,
        sizing_mode="stretch_width",
        x_range=Range1d(0, 100),
        toolbar_location=None,
        tools="",
    )
    fig.hbar(y="y", right=value, height=0.7, color="color", alpha=0.75, source=source)
    fig.text(x=1, y="y", text="label", source=source, text_baseline="middle", text_font_size="11px")
    fig.text(
        x=99,
        y="y",
        text=text,
        source=source,
        text_align="right",
        text_baseline="middle",
        text_font_size="11px",
    )
    fig.add_tools(
        HoverTool(tooltips=[("rank", "@label"), (title, f"@{text}"), ("state", "@status")])
    )
    fig.yaxis.visible = False
    fig.ygrid.visible = False
    fig.y_range.flipped = True  # rank 0 on top
    fig.xaxis.axis_label = "%"
    return fig


def utilization_figure(source):
    """Bars per rank: GPU utilization (the worker's CPU on a CPU rank)."""
    return _bars(source, "util", "util_text", "utilization")


def memory_figure(source):
    """Bars per rank: device memory in use (the worker's RSS on a CPU rank)."""
    return _bars(source, "mem", "mem_text", "memory")


def loss_figure(source):
    """The loss against the step, one line per rank."""
    from bokeh.models import HoverTool
    from bokeh.plotting import figure

    fig = figure(
        title=LOSS,
        height=240,
        sizing_mode="stretch_width",
        toolbar_location="above",
        tools="pan,wheel_zoom,box_zoom,reset",
    )
    fig.multi_line(xs="xs", ys="ys", line_color="color", line_width=2, source=source)
    fig.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("step", "$x{0}"), (LOSS, "$y")]))
    fig.xaxis.axis_label = "step"
    return fig


def layout(bars, loss):
    """The three figures in a column, on two data sources."""
    from bokeh.layouts import column

    return column(
        utilization_figure(bars),
        memory_figure(bars),
        loss_figure(loss),
        sizing_mode="stretch_width",
    )


_pages: dict[tuple[str, int], str] = {}


def page_html(data_url: str, interval_ms: int = 1000) -> str:
    """A standalone page whose figures poll ``data_url`` (``/monarch/figures.json``). Bokeh's
    JavaScript is inlined: the page must work offline and behind the Jupyter server's proxy."""
    key = (data_url, interval_ms)
    if key not in _pages:
        from bokeh.embed import file_html
        from bokeh.models import AjaxDataSource, CustomJS
        from bokeh.resources import INLINE

        def source(part: str):
            return AjaxDataSource(
                data_url=data_url,
                polling_interval=interval_ms,
                mode="replace",
                method="GET",
                adapter=CustomJS(code=f"return cb_data.response.{part}"),
            )

        _pages[key] = file_html(layout(source("bars"), source("loss")), INLINE, "monarch")
    return _pages[key]


def figure_columns(payload: dict[str, Any]) -> dict[str, dict[str, list]]:
    """What ``/monarch/figures.json`` serves: the columns of both data sources."""
    view = rank_view(payload)
    return {"bars": bar_columns(view), "loss": loss_columns(view)}
