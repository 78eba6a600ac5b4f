"""The live panel under a `%%monarch` cell in a real JupyterLab in headless Chromium: it draws
and changes while the ranks train, freezes into a static picture when the cell ends, and that
picture is what the saved notebook shows when it is opened again; `%monarch dashboard` too,
until the cluster goes down. Screenshots land in tests/artifacts/panel-*.png."""

from __future__ import annotations

import io
import time

import pytest
from _lab import ARTIFACTS, Lab, append_cell, chromium, requires_chromium

pytestmark = requires_chromium

NAME = "panel.ipynb"
TRAIN = """\
%%monarch
import math, time
import monarch_nb
for step in range(80):
    monarch_nb.log(step=step, loss=2.0 * math.exp(-step / (10 + 10 * rank)) + 0.02 * rank)
    time.sleep(0.1)
"""
# A cluster started with --ft, faked (no torchft here): what controller/healing.py records, written
# by a thread of the kernel as the ranks' steps go by: rank 1 lost at step 104, its replacement
# joining at 118, healing at 122, back at 125
FAKE_FT = """\
import threading, time, types
import monarch_nb
ctl = monarch_nb.current()
ctl.ft = types.SimpleNamespace(address="fake", alive=True, close=lambda: None)
MARKS = {104: ("lost", 1), 118: ("joining", None), 122: ("healing", 1), 125: ("back", 2)}

def fake_ft():
    seen, deadline = 99, time.monotonic() + 120
    while seen < 132 and time.monotonic() < deadline:
        step = (ctl.metrics.latest().get(0) or {}).get("step") or 0
        for s in range(seen + 1, step + 1):
            ctl.ft_steps.append((time.time(), s, 1 if 104 <= s < 125 else 2))
            if s in MARKS:
                event, n = MARKS[s]
                at = None if event == "joining" else s
                ctl.ft_events.append(
                    {"time": time.time(), "rank": 1, "event": event, "step": at, "participants": n}
                )
        seen = max(seen, step)
        time.sleep(0.05)

threading.Thread(target=fake_ft, daemon=True).start()
"""
FT_TRAIN = """\
%%monarch
import math, time
import monarch_nb
for step in range(100, 133):
    monarch_nb.log(step=step, loss=2.0 * math.exp(-(step - 100) / (10 + 10 * rank)) + 0.02 * rank)
    time.sleep(0.1)
"""
BROKEN = ("Error displaying widget", "model not found", "Javascript Error", "Failed to create")

# the cell's output as the page shows it: the panel's picture, and whether a widget holds it
OUTPUT_JS = """(index) => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const cell = nb.widgets[index];
  if (!cell) return null;
  const out = cell.outputArea.node;
  const svg = out.querySelector('.monarch-panel svg');
  return {
    svg: !!svg,
    widget: !!out.querySelector('.jupyter-widgets .monarch-panel'),
    text: out.innerText,
    running: cell.model.executionState === 'running',
  };
}"""


def run_cell(page, source: str) -> int:
    """Append ``source`` as a code cell and run it (without waiting); its index."""
    return append_cell(page, source, run=True)


def open_notebook(page, lab: Lab) -> None:
    page.goto(f"{lab.url}/lab/tree/{NAME}?token={lab.token}")
    page.wait_for_function(
        "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
        timeout=120_000,
    )


def wait_output(page, index: int, test: str, timeout: float) -> dict:
    page.wait_for_function(f"(i) => {{ const o = ({OUTPUT_JS})(i); return o && ({test}); }}",
                           arg=index, timeout=timeout * 1000)  # fmt: skip
    return page.evaluate(OUTPUT_JS, index)


BOX_JS = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
  const el = cell.outputArea.node.querySelector('.monarch-panel');
  el.scrollIntoView({block: 'center'});
  const b = el.getBoundingClientRect();
  return {x: b.x, y: b.y, width: b.width, height: b.height};
}"""


def shot(page, index: int, name: str) -> bytes:
    # the panel's node is replaced at every update: take its box, then the page's pixels
    box = page.evaluate(BOX_JS, index)
    deadline = time.monotonic() + 20
    while not (box["width"] and box["height"]):  # a reopened notebook still laying out
        assert time.monotonic() < deadline, f"the panel of cell {index} has no size: {box}"
        page.wait_for_timeout(250)
        box = page.evaluate(BOX_JS, index)
    png = page.screenshot(clip=box)
    (ARTIFACTS / name).write_bytes(png)
    return png


@pytest.mark.timeout(600)
def test_the_panel_is_live_then_frozen_and_the_saved_notebook_shows_its_picture(
    tmp_path,
):
    import nbformat
    from PIL import Image, ImageChops

    ARTIFACTS.mkdir(exist_ok=True)
    lab = Lab(tmp_path, expose_app=True)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, lab.root / NAME)
    try:
        lab.wait_ready()
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            open_notebook(page, lab)
            up = run_cell(page, "%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist")
            shown = wait_output(page, up, "!o.running && o.text.includes('2 ranks')", 180)
            assert "started 2 ranks" in shown["text"], shown["text"]

            index = run_cell(page, TRAIN)
            live = wait_output(page, index, "o.widget && o.text.includes('step')", 120)
            assert live["running"], "the cell ended before its panel showed steps"
            first = shot(page, index, "panel-live-0.png")
            page.wait_for_timeout(2500)
            second = shot(page, index, "panel-live-1.png")
            assert page.evaluate(OUTPUT_JS, index)["running"], "the cell ended too soon"
            a, b = (Image.open(io.BytesIO(p)).convert("RGB") for p in (first, second))
            assert a.size == b.size, "the panel changed size while it updated"
            assert ImageChops.difference(a, b).getbbox(), "the panel did not change in 2.5 s"

            frozen = wait_output(page, index, "!o.running && o.svg && !o.widget", 120)
            assert "done" in frozen["text"] and not any(t in frozen["text"] for t in BROKEN)
            shot(page, index, "panel-frozen.png")

            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            saved = time.monotonic()
            while time.monotonic() - saved < 30:
                outputs = nbformat.read(lab.root / NAME, 4).cells[index].outputs
                if outputs and any("text/html" in o.get("data", {}) for o in outputs):
                    break
                page.wait_for_timeout(500)
            kinds = [sorted(o.get("data", {})) for o in outputs if o.get("data")]
            assert ["text/html", "text/plain"] in kinds, kinds
            assert not any("application/vnd.jupyter.widget-view+json" in k for k in kinds)

            page.reload()
            open_notebook(page, lab)
            reopened = wait_output(page, index, "o.svg", 60)
            assert not reopened["widget"] and not any(t in reopened["text"] for t in BROKEN)
            shot(page, index, "panel-reopened.png")

            # on a cluster started with --ft: a rank's way back, the participants per step
            fake = run_cell(page, FAKE_FT)
            wait_output(page, fake, "!o.running", 60)
            ft = run_cell(page, FT_TRAIN)
            wait_output(page, ft, "o.widget && o.text.includes('lost at step 104')", 120)
            shot(page, ft, "panel-ft-live.png")
            ended = wait_output(page, ft, "!o.running && o.svg && !o.widget", 120)
            assert "participants per step" in ended["text"], ended["text"]
            assert "rank 1 back at step 125" in ended["text"], ended["text"]
            assert not any(t in ended["text"] for t in BROKEN)
            shot(page, ft, "panel-ft-frozen.png")
            wait_output(page, run_cell(page, "monarch_nb.current().ft = None"), "!o.running", 30)

            # %monarch dashboard: live until the cluster goes down, then its last picture
            dash = run_cell(page, "%monarch dashboard")
            wait_output(page, dash, "!o.running && o.widget && o.text.includes('rank 1')", 60)
            down = run_cell(page, "%monarch down")
            wait_output(page, down, "!o.running", 120)
            ended = wait_output(page, dash, "o.svg && !o.widget", 30)
            assert "down at" in ended["text"] and "lost" not in ended["text"]
            assert not any(t in ended["text"] for t in BROKEN)
            shot(page, dash, "panel-dashboard-down.png")
            assert not errors, errors
    finally:
        lab.stop()
