"""The live panel and %monarch plot, against a real cluster logging real metrics."""

from __future__ import annotations

import collections
import time

import pytest

from monarch_nb import widgets
from monarch_nb.widgets import CellWatch, LivePanel, widgets_available


def test_panel_state_changes_while_a_cell_runs(clean):
    panel = LivePanel(clean, hz=10)
    handle = clean.run(
        "import time\n"
        "from monarch_nb import log\n"
        "for step in range(12):\n"
        "    log(step=step, loss=1.0 / (step + 1) + rank)\n"
        "    time.sleep(0.1)\n"
        "rank",
        block=False,
    )
    panel.track(handle._req)
    panel.start()
    seen_running, updates = False, []
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:
        states = panel.cell_states()
        seen_running |= bool(states) and all(s == "running" for s, _ in states.values())
        updates.append(panel.updates)
        time.sleep(0.1)
    handle.result(timeout=30)
    time.sleep(1.5)  # the last batches (every 0.5 s) reach the controller
    panel.refresh()
    panel.close()
    assert seen_running and len(set(updates)) > 1
    assert {s for s, _ in panel.cell_states().values()} == {"done"}
    bars = panel._bars.data
    assert bars["rank"] == ["0", "1"] and all(0 <= u <= 100 for u in bars["util"])
    assert "rank 0: done" in panel.states.value
    assert panel._bars.data["status"] == ["done", "done"]  # the hover's state (not "gone")
    losses = dict(zip(panel._loss.data["rank"], panel._loss.data["ys"], strict=True))
    assert losses["1"][-1] == pytest.approx(1 + 1 / 12)


def test_error_state_is_shown(clean):
    panel = LivePanel(clean)
    try:
        handle = clean.run("1 / 0 if rank == 1 else 0", block=False)
        panel.track(handle._req)
        with pytest.raises(Exception, match="ZeroDivisionError"):
            handle.result(timeout=30)
        panel.refresh()
        assert panel.cell_states()[1][0] == "error"
        assert "rank 1: error" in panel.states.value
    finally:
        panel.close()


def test_past_the_kept_panels_the_oldest_becomes_a_snapshot_with_its_widgets_closed(
    clean, monkeypatch
):
    monkeypatch.setattr(widgets, "KEEP_PANELS", 2)
    monkeypatch.setattr(widgets, "_kept", collections.deque())

    class Handle:
        shown = None

        def update(self, bundle, raw):
            self.shown = bundle

    panels = [LivePanel(clean, title=f"cell {i}") for i in range(3)]
    handles = [Handle() for _ in panels]
    for panel, handle in zip(panels, handles, strict=True):
        widgets.keep(panel, handle)
    assert handles[0].shown is not None and handles[1].shown is None
    assert "cell 0" in handles[0].shown["text/html"]
    assert "%monarch plot shows what the ranks logged" in handles[0].shown["text/html"]
    assert panels[0].widget.comm is None and panels[0].figures.comm is None  # closed
    assert panels[1].widget.comm is not None
    for panel in panels[1:]:
        panel.dispose()


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
    assert type(cell("%monarch plot")).__name__ == "BokehModel"
    cell("%monarch dashboard")
    assert "rank" in cell.out  # text fallback without a kernel: the latest values table
