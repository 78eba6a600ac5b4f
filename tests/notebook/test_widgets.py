"""The live panel and %monarch plot, against a real cluster logging real metrics; the panel's
SVG renderer on hand-made views (non-finite values, too many points, many ranks)."""

from __future__ import annotations

import collections
import math
import os
import signal
import time
import xml.etree.ElementTree as ET

import pytest
from IPython.utils.capture import capture_output
from ipywidgets import DOMWidget

import monarch_nb
from monarch_nb import CellError
from monarch_nb.notebook import panel_charts, panel_compact, panel_svg, rank_groups, widgets
from monarch_nb.notebook.widgets import NO_WIDGETS, CellWatch, LivePanel, widgets_available
from monarch_nb.telemetry.store import Store

SVG = "{http://www.w3.org/2000/svg}"


def svg_of(html: str) -> ET.Element:
    """The panel's <svg>, parsed as XML (a malformed picture fails here)."""
    start, end = html.index("<svg"), html.index("</svg>") + len("</svg>")
    return ET.fromstring(html[start:end])


def loss_lines(html: str) -> dict[str, list[str]]:
    """rank -> the points of its line in the loss chart (the first chart drawn)."""
    lines = {}
    for line in svg_of(html).iter(f"{SVG}polyline"):
        lines.setdefault(line.get("data-rank"), line.get("points").split())
    return lines


def texts(html: str) -> list[str]:
    return [t.text or "" for t in svg_of(html).iter(f"{SVG}text")]


@pytest.fixture
def fresh():
    """A cluster of its own: the shared one's store holds the steps earlier tests logged, and a
    rank's loss line continues from its last step, so this cell's first steps would not show."""
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False, current=False)
    yield ctl
    ctl.down()


def test_panel_state_changes_while_a_cell_runs(fresh):
    panel = LivePanel(fresh, hz=10)
    handle = fresh.run(
        "import time\n"
        "from monarch_nb import log\n"
        "for step in range(12):\n"
        "    log(step=step, loss=1.0 / (step + 1) + rank)\n"
        "    time.sleep(0.1)\n"
        "rank",
        block=False,
    )
    panel.track(handle._req)
    assert "running" in " ".join(texts(panel.widget.value))  # from the first picture on
    panel.start()
    seen_running, updates, pictures = False, [], set()
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:
        states = panel.cell_states()
        seen_running |= bool(states) and all(s == "running" for s, _ in states.values())
        updates.append(panel.updates)
        pictures.add(panel.widget.value)
        time.sleep(0.1)
    handle.result(timeout=30)
    final = panel.freeze()  # waits for what the ranks logged last (catch_up)
    assert seen_running and len(set(updates)) > 1 and len(pictures) > 1
    assert {s for s, _ in panel.cell_states().values()} == {"done"}
    assert texts(final).count("done") == 2
    rows = {r["rank"]: r for r in panel.view["ranks"]}
    assert all(rows[r]["util"] >= 0 for r in (0, 1))
    assert rows[1]["loss"] == pytest.approx(1 + 1 / 12) and rows[1]["step"] == 11
    assert {k: len(v) for k, v in loss_lines(final).items()} == {"0": 12, "1": 12}
    assert panel.widget.comm is None  # closed on freeze


def test_the_panel_of_a_cell_that_logs_nothing_shows_no_earlier_losses(clean):
    """It showed the losses and the step an earlier cell logged, as if this cell had."""
    clean.run("from monarch_nb import log\nfor step in range(5):\n    log(step=step, loss=2.0)")
    clean.metrics.catch_up()
    assert all(e["values"].get("loss") == 2.0 for e in clean.metrics.snapshot()["ranks"])
    panel = LivePanel(clean)
    handle = clean.run("import time\ntime.sleep(0.5)\nrank", block=False)
    panel.track(handle._req)
    assert handle.result(timeout=30).values() == [0, 1]
    final = panel.freeze()
    assert panel.view["loss"] == []  # the chart's lines
    assert panel_svg.NO_LOSS_IN_CELL in texts(final)
    assert [(r["step"], r["loss"], r["state"]) for r in panel.view["ranks"]] == [
        (None, None, "done")
    ] * 2
    assert "step 4" not in " ".join(texts(final))


def test_error_state_is_shown(clean):
    panel = LivePanel(clean)
    try:
        handle = clean.run("1 / 0 if rank == 1 else 0", block=False)
        panel.track(handle._req)
        with pytest.raises(Exception, match="ZeroDivisionError"):
            handle.result(timeout=30)
        panel.refresh()
        assert panel.cell_states()[1][0] == "error"
        assert "error" in texts(panel.widget.value)
    finally:
        panel.freeze()


def test_a_rank_whose_worker_dies_shows_as_lost():
    own = monarch_nb.up(workers=2, cpu=True, dist=False, current=False)
    try:
        pid = own.run("import os\nos.getpid()", targets=1).item()
        panel = LivePanel(own)
        handle = own.run("import time\ntime.sleep(30 if rank == 1 else 0)", block=False)
        panel.track(handle._req)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CellError):
            handle.result(timeout=20)
        final = panel.freeze()
        assert panel.cell_states() == {0: ("done", None), 1: ("lost", None)}
        assert "lost" in texts(final)
    finally:
        own.down()


def test_the_panel_is_shown_with_a_static_copy_and_freezes_into_it(shell, clean, monkeypatch):
    monkeypatch.setattr(widgets, "_kept", collections.deque())
    with capture_output() as shown:
        panel = LivePanel(clean, title="a cell")
        panel.show()
        widgets.keep(panel, panel.handle)
        frozen = panel.freeze()
        assert panel.freeze() is frozen  # once
    first, update = shown.outputs
    assert set(first.data) == {
        "application/vnd.jupyter.widget-view+json",
        "text/html",
        "text/plain",
    }
    assert first.data["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert widgets.NO_WIDGET_MANAGER in first.data["text/html"]  # why, where it is not live
    assert update.update and set(update.data) == {"text/html", "text/plain"}
    assert update.data["text/html"] == frozen and "<svg" in frozen and "a cell" in texts(frozen)
    assert update.transient["display_id"] == first.transient["display_id"]
    assert panel.widget.comm is None and not widgets._kept


def test_past_the_kept_panels_the_oldest_finished_one_is_frozen(shell, clean, monkeypatch):
    monkeypatch.setattr(widgets, "KEEP_PANELS", 2)
    monkeypatch.setattr(widgets, "_kept", collections.deque())
    running = clean.run("import time\ntime.sleep(2)", block=False)
    with capture_output():
        panels = [LivePanel(clean, title=f"cell {i}") for i in range(4)]
        panels[0].track(running._req)  # a cell still running keeps its panel
        for panel in panels:
            widgets.keep(panel, panel.show())
        assert [p.frozen is not None for p in panels] == [False, True, True, False]
        assert panels[1].widget.comm is None and "cell 1" in texts(panels[1].frozen)
        assert panels[0].widget.comm is not None and panels[3].widget.comm is not None
        running.result(timeout=30)
        for panel in panels:
            panel.freeze()


def test_without_a_kernel_cells_get_no_panel(clean):
    assert not widgets_available()  # a plain IPython shell has no kernel to render widgets
    watch = CellWatch(clean, block=True)
    clean.run("1", watch=watch)
    watch.finish()
    assert watch.panel is None


def test_plot_and_dashboard_magics(cell, clean, tmp_path):
    cell("%%monarch\nfrom monarch_nb import log\nfor s in range(3): log(step=s, loss=3.0 - s)")
    time.sleep(1.2)
    target = tmp_path / "run.html"
    cell(f"%monarch plot --save {target}")
    assert "wrote" in cell.out and "<html" in target.read_text()
    cell(f"%monarch plot --save {tmp_path / 'run.png'}", expect_error=True)
    assert "standalone .html" in str(cell.error)
    assert isinstance(cell("%monarch plot"), DOMWidget)  # the figures' own widget
    cell("%monarch dashboard")
    # without a kernel: the latest values as text, and one line saying why
    assert "rank" in cell.out and NO_WIDGETS in cell.out


# -- the renderer alone ----------------------------------------------------------------------
def snapshot(n_ranks: int, steps: int, loss=lambda rank, step: 1.0 / (step + 1)) -> dict:
    now = time.time()
    ranks = []
    for rank in range(n_ranks):
        rows = [[s, now - steps + s, {"loss": loss(rank, s)}] for s in range(steps)]
        samples = [
            {"time": now - 30 + i, "kind": "cuda", "device": "MI300X", "util": 50.0 + i,
             "mem_used": (1 + i) * 2**30, "mem_total": 192 * 2**30, "cpu": 100.0}
            for i in range(30)
        ]  # fmt: skip
        ranks.append(
            {"rank": rank, "worker": str(rank), "host": "node", "step": steps - 1,
             "values": rows[-1][2] if rows else {}, "sample": samples[-1], "scalars": rows,
             "samples": samples, "rows": steps}
        )  # fmt: skip
    return {"time": now, "ranks": ranks}


def test_non_finite_losses_leave_a_valid_picture_without_them():
    bad = {3: math.nan, 5: math.inf, 7: -math.inf}
    view = panel_svg.panel_view(snapshot(2, 10, lambda r, s: bad.get(s, 1.0 + s)), {})
    html = panel_svg.render(view, "t")
    assert {k: len(v) for k, v in loss_lines(html).items()} == {"0": 7, "1": 7}
    assert "nan" not in html.lower() and "inf" not in html.lower()
    store = Store()  # the controller's store: the latest loss diverged
    rows = [[0, time.time(), {"loss": 1.5}], [1, time.time(), {"loss": math.nan}]]
    store.add({"rank": 0, "worker": "w", "host": "h", "scalars": rows})
    html = panel_svg.render(panel_svg.panel_view(store.snapshot(), {}), "t")
    assert "step 1 · loss not finite" in texts(html)
    assert {k: len(v) for k, v in loss_lines(html).items()} == {"0": 1}


def test_too_many_points_are_thinned_with_a_note():
    view = panel_svg.panel_view(snapshot(1, 5000), {})
    html = panel_svg.render(view, "t")
    assert len(loss_lines(html)["0"]) == panel_svg.MAX_POINTS
    assert any("thinned to" in t for t in texts(html))


def test_the_size_depends_on_the_number_of_ranks_only():
    def size(n: int, steps: int, state: str) -> str:
        view = panel_svg.panel_view(snapshot(n, steps), {r: (state, 1.5) for r in range(n)})
        svg = svg_of(panel_svg.render(view, "t"))
        return svg.get("viewBox")

    assert size(2, 0, "queued") == size(2, 500, "running")
    assert size(16, 2, "queued") == size(300, 50, "running")  # the compact form


def test_from_16_ranks_the_panel_is_compact_names_the_odd_ranks_and_stays_small():
    def picture(n: int, steps: int = 400) -> str:
        # rank 12's loss six times the others'; rank 3 failed
        snap = snapshot(n, steps, lambda r, s: (6.0 if r == 12 else 1.0) / (s + 1) + 1e-3 * (r % 3))
        states = {r: ("error" if r == 3 else "running", 2.0) for r in range(n)}
        return panel_svg.render(panel_svg.panel_view(snap, states), "t")

    html = picture(64)
    svg = svg_of(html)
    shown = ["".join(t.itertext()) for t in svg.iter(f"{SVG}text")]
    assert "running ranks 0-2,4-63 (2.0 s) · error rank 3 (2.0 s)" in shown
    assert not any(t.startswith("rank 5 ·") for t in shown), "no row per rank"
    assert any("apart from the others: rank 12" in t for t in shown)
    assert set(loss_lines(html)) == {"12", None}  # the odd rank's line, and the bands' medians
    cells = [r for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(cells) == 2 * 64  # a utilization and a memory cell per rank
    assert cells[5].find(f"{SVG}title").text == "rank 5: 79%"
    for n, steps in ((16, 400), (64, 400), (1000, 150)):  # past 64 ranks, a cell is several
        assert len(picture(n, steps)) <= panel_compact.MAX_BYTES, n
    under = panel_svg.render(panel_svg.panel_view(snapshot(15, 2), {}), "t")
    assert "rank 14 · MI300X · node" in texts(under)  # under 16 ranks: a row per rank


def test_lost_ranks_and_empty_charts_say_so():
    view = panel_svg.panel_view({"ranks": []}, {0: ("running", 2.0), 1: ("lost", None)})
    shown = " ".join(texts(panel_svg.render(view, "t")))
    assert "running 2.0 s" in shown and "lost" in shown
    assert "no loss yet" in shown and "no samples yet" in shown


def test_ticks_are_round_and_cover_the_range():
    assert panel_charts.nice_ticks(0.0, 100.0) == [0, 25, 50, 75, 100]
    ticks = panel_charts.nice_ticks(0.013, 0.87)
    assert ticks[0] <= 0.013 and ticks[-1] >= 0.87 and len(ticks) <= 7
    assert panel_charts.nice_ticks(5.0, 5.0)[0] < 5.0 < panel_charts.nice_ticks(5.0, 5.0)[-1]


def test_a_thousand_ranks_on_sixteen_hosts_read_by_host():
    """The panel and ``%monarch status`` at 1,024 ranks, 64 on each of 16 hosts: each host
    named once under its ranks, and one status row per host (and one for a lost rank)."""
    snap = snapshot(1024, 20)
    for row in snap["ranks"]:
        row["host"] = f"n{row['rank'] // 64:02d}"
    states = {r: ("running", 2.0) for r in range(1024)}
    states[300] = ("lost", None)
    html = panel_svg.render(panel_svg.panel_view(snap, states), "t")
    assert len(html) <= panel_compact.MAX_BYTES
    shown = ["".join(t.itertext()) for t in svg_of(html).iter(f"{SVG}text")]
    assert "running ranks 0-299,301-1023 (2.0 s) · lost rank 300" in shown
    assert [t for t in shown if t.startswith("n")] == [f"n{h:02d}" for h in range(16)]
    rows = [
        {"rank": r, "host": f"n{r // 64:02d}", "device": "cuda: MI300X", "pid": 1000 + r,
         "state": "lost" if r == 300 else f"busy {2 + r / 1024:.1f} s"}
        for r in range(1024)
    ]  # fmt: skip
    grouped, columns = rank_groups.group(rows, ["rank", "host", "device", "state", "pid"])
    assert columns == ["ranks", "host", "device", "state"]
    assert [(g["ranks"], g["host"]) for g in grouped][3:6] == [
        ("192-255", "n03"),
        ("256-299,301-319", "n04"),
        ("300", "n04"),
    ]
    assert len(grouped) == 17 and grouped[0]["state"] == "busy 2 s"
