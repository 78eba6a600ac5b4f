"""What a person sees: every notebook in notebooks/ run top to bottom in a real JupyterLab in
headless Chromium, and the live views (panel, tqdm bars, widgets on ranks) checked in the page.

A notebook fails on an error output in a cell not tagged `raises-exception`, any output showing
a JavaScript or widget error, a browser console error or page error (while it runs, and as its
kernel is shut down and the notebook closed), any request to a host other than 127.0.0.1, and a
bokeh figure whose canvas is blank. Screenshots land in tests/artifacts/;
the README's pictures (docs/images/) are written here too, only from views that passed."""

from __future__ import annotations

import asyncio
import io
import shutil
import time
from pathlib import Path

import pytest
from _lab import ARTIFACTS, Lab, chromium, requires_chromium
from _notebook_checks import CHECKS
from _notebook_page import (
    CHART_BOX_JS,
    NotebookPage,
    blank_fraction,
    cell_problems,
    figure_problems,
    plain,
    shot,
)

pytestmark = requires_chromium

REPO = Path(__file__).parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
IMAGES = REPO / "docs" / "images"
# Every cell stays in the DOM, so figures below the fold are laid out and drawn too.
SETTINGS = {"@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"}}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lab")
    lab = Lab(tmp, settings=SETTINGS, expose_app=True)
    # the notebooks alone, as a teacher hands them out: what they run ships in the package
    for path in NOTEBOOKS:
        shutil.copy(path, lab.root / path.name)
    try:
        lab.wait_ready()
        yield lab
    finally:
        lab.stop()


@pytest.fixture(autouse=True)
def jp_asyncio_loop():
    """Where pytest-jupyter is loaded (other modules load it), its per-test loop would be the
    one that playwright's sync API keeps running in this thread for the module's browser, and
    closing it after each test fails: each test gets a loop of its own instead."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as browser:
        yield browser


def test_there_are_notebooks():
    assert any(p.name == "03-monarch-matrices.ipynb" for p in NOTEBOOKS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_the_browser_and_shows_nothing_broken(lab, browser, path):
    stem = path.stem
    nbpage = NotebookPage(browser, lab, path.name)
    try:
        started = time.monotonic()
        nbpage.command("notebook:run-all-cells", timeout=780)
        took = time.monotonic() - started
        nbpage.page.wait_for_timeout(2000)  # widgets render and figures draw after the replies
        cells = nbpage.cells()
        picture = None
        if path.name == "03-monarch-matrices.ipynb" and any(c["figures"] for c in cells):
            # before the figures' own screenshots scroll a wide row sideways
            first = next(c for c in cells if c["figures"])
            picture = shot(nbpage.cell(first["index"]).locator(".jp-OutputArea"))
        problems = cell_problems(cells)
        problems += figure_problems(nbpage, cells, stem)
        nbpage.page.screenshot(path=str(ARTIFACTS / f"{stem}.png"))
        for cell in cells:
            if any(f"cell {cell['index']} " in p for p in problems):
                shot(nbpage.cell(cell["index"]), ARTIFACTS / f"{stem}-cell{cell['index']}.png")
        nbpage.shut_down()  # and closed: page errors as its widgets see their kernel go count
        problems += nbpage.watch.problems
        print(f"{path.name}: ran in {took:.1f} s")
        assert not problems, f"{path.name} in JupyterLab:\n" + "\n".join(problems)
        if path.name in CHECKS:  # what it prints (tests/_notebook_checks.py)
            CHECKS[path.name](cells)
        if picture is not None:
            IMAGES.mkdir(parents=True, exist_ok=True)
            (IMAGES / "monarch-matrices-figure.png").write_bytes(picture)
    finally:
        nbpage.close()


BROKEN = [
    # a JavaScript output that throws, as a figure's loader does when BokehJS is missing
    "from IPython.display import Javascript, display\n"
    "display(Javascript(\"throw new Error('no BokehJS')\"))",
    # a console error, as a widget manager logs for a model it cannot find
    "display(Javascript(\"console.error('Could not create a view for model id 1')\"))",
    # a request leaving the machine, as a figure that fetches BokehJS from a CDN
    "from IPython.display import HTML\n"
    "display(HTML('<img src=\"http://cdn.example.invalid/bokeh.min.js\">'))",
    # a bokeh canvas that nothing was drawn on
    'display(HTML(\'<div class="bk-Canvas" style="width:200px;height:120px">'
    '<canvas width="200" height="120"></canvas></div>\'))',
    # Dask's own logging in a cell, as a nanny's warning that reaches the kernel's stderr
    "import sys\n"
    "print('2026-12-01 15:38:57,297 - distributed.nanny - WARNING - Restarting worker',"
    " file=sys.stderr)",
    # an error in a cell not tagged raises-exception
    "1 / 0",
]


@pytest.mark.timeout(300)
def test_the_checks_name_each_thing_a_person_would_see_broken(lab, browser):
    """The checks themselves, on a notebook broken on purpose: each breakage is named."""
    import nbformat

    name = "broken-on-purpose.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in BROKEN])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, lab.root / name)
    nbpage = NotebookPage(browser, lab, name)
    try:
        nbpage.command("notebook:run-all-cells", timeout=120)
        nbpage.page.wait_for_timeout(1000)
        cells = nbpage.cells()
        problems = cell_problems(cells) + figure_problems(nbpage, cells, "broken-on-purpose")
        problems += nbpage.watch.problems
    finally:
        nbpage.close()
    report = "\n".join(problems)
    for expected in (
        "cell 0 ('from IPython.display import Javascript, display') shows 'Javascript Error'",
        "console error: Could not create a view for model id 1",
        "request to a host other than 127.0.0.1: http://cdn.example.invalid/bokeh.min.js",
        "bokeh figure 0: its canvas is blank",
        "cell 4 ('import sys') shows Dask's own log line: '2026-12-01 15:38:57,297 - "
        "distributed.nanny - WARNING - Restarting worker'",
        "cell 5 ('1 / 0') raised ZeroDivisionError: division by zero",
    ):
        assert expected in report, f"{expected!r} not reported; the checks said:\n{report}"


# -- the live views, on one cluster of 2 CPU ranks in one notebook --------------------------


START = "%load_ext monarch_nb\n%monarch up --workers 2 --cpu --no-dist"


@pytest.fixture(scope="module")
def live(lab, browser):
    import nbformat

    name = "live-views.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(START)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, lab.root / name)
    nbpage = NotebookPage(browser, lab, name)
    try:
        up = nbpage.run_cell(0, 180)
        assert "2 ranks" in up["text"], up["text"]
        yield nbpage
        nbpage.run("%monarch down", 120)
    finally:
        nbpage.close()


TRAIN = """\
%%monarch
import math, time
import monarch_nb
for step in range(110):
    monarch_nb.log(step=step, loss=2.0 * math.exp(-step / (20 + 20 * rank)))
    time.sleep(0.1)
"""


@pytest.mark.timeout(300)
def test_the_live_panel_changes_while_a_cell_runs(live):
    from PIL import Image, ImageChops

    seen = len(live.watch.problems)
    index = live.start(TRAIN)
    cell = live.cell(index)
    live.page.wait_for_function(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i]"
        ".outputArea.node.querySelector('.jupyter-widgets, .widget-vbox')",
        arg=index,
        timeout=60_000,
    )
    cell.scroll_into_view_if_needed()
    live.page.wait_for_timeout(2000)  # the panel's first draw
    captures = []
    for n in range(2):
        problems = cell_problems([live.cells()[index]], finished=False)
        assert not problems, "\n".join(problems)
        box = live.page.evaluate(CHART_BOX_JS, index)
        assert box, "the live panel shows no chart (no canvas or svg in the cell's output)"
        captures.append(live.page.screenshot(clip=box))
        (ARTIFACTS / f"live-panel-{n}.png").write_bytes(captures[-1])
        if n == 0:
            live.page.wait_for_timeout(3000)
    still_running = live.cells()[index]["count"] is None
    assert still_running, "the training cell ended before the second capture"
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in captures]
    assert blank_fraction(captures[1]) < 0.99, "the live panel's chart area is blank"
    assert images[0].size != images[1].size or ImageChops.difference(*images).getbbox(), (
        "the live panel's chart area did not change in 3 s while the ranks logged a loss "
        "every 0.1 s (tests/artifacts/live-panel-0.png, live-panel-1.png)"
    )
    IMAGES.mkdir(parents=True, exist_ok=True)
    shot(cell.locator(".jp-OutputArea"), IMAGES / "live-panel.png")

    # the sidebar beside it, while the ranks train
    tab = live.page.locator('.jp-SideBar [data-id="monarch-sidebar"]')
    tab.click()
    bars = live.page.locator("#monarch-sidebar .monarch-BarChart-util .monarch-bar")
    bars.nth(1).wait_for(timeout=30_000)
    live.page.locator("#monarch-sidebar .monarch-loss-line").nth(1).wait_for(timeout=30_000)
    live.page.screenshot(path=str(IMAGES / "sidebar.png"))
    tab.click()
    live.page.wait_for_function(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].model.executionCount",
        arg=index,
        timeout=120_000,
    )
    problems = cell_problems([live.cells()[index]]) + live.watch.problems[seen:]
    assert not problems, "\n".join(problems)


TQDM = """\
%%monarch
import time
from tqdm.notebook import tqdm
for _ in tqdm(range(30)):
    time.sleep(0.03)
"""


@pytest.mark.timeout(180)
def test_a_tqdm_notebook_loop_on_two_ranks_ends_with_two_bars(live):
    seen = len(live.watch.problems)
    cell = live.run(TQDM)
    problems = cell_problems([cell]) + live.watch.problems[seen:]
    assert not problems, "\n".join(problems)
    bars = live.cell(cell["index"]).locator(".jp-OutputArea .widget-hprogress")
    shot(live.cell(cell["index"]), ARTIFACTS / "tqdm.png")
    assert bars.count() == 2, (
        f"expected one tqdm bar per rank, found {bars.count()}; the output reads:\n{cell['text']}"
    )
    assert cell["text"].count("30/30") == 2, cell["text"]
    assert "rank 0" in cell["text"] and "rank 1" in cell["text"], cell["text"]


def rank_0_reads(live, name: str, value: int, seconds: float = 15) -> str:
    """What ``name.value`` reads on rank 0, asked until it is ``value`` (the browser's change
    is on its way) or ``seconds`` pass: the last answer's text."""
    deadline = time.monotonic() + seconds
    while True:
        back = plain(live.run(f"%%monarch --targets 0\n{name}.value"))
        if f"ValueMesh({{0: {value}}})" in back or time.monotonic() > deadline:
            return back.strip()
        live.page.wait_for_timeout(500)


@pytest.mark.timeout(180)
def test_a_slider_on_a_rank_moved_in_the_browser_changes_the_value_on_the_rank(live):
    from playwright.sync_api import expect

    seen = len(live.watch.problems)
    shown = live.run(
        "%%monarch --targets 0\nimport ipywidgets\n"
        "slider = ipywidgets.IntSlider(value=3, min=0, max=10)\ndisplay(slider)"
    )
    problems = cell_problems([shown]) + live.watch.problems[seen:]
    assert not problems, "\n".join(problems)
    out = live.cell(shown["index"]).locator(".jp-OutputArea")
    handle = out.locator(".noUi-handle")
    if not handle.count():
        shot(out, ARTIFACTS / "slider.png")
        pytest.fail(f"no slider in the output of the rank's display(); it reads {shown['text']!r}")
    handle.click()
    readout = out.locator(".widget-readout")
    for value in range(4, 8):  # a step at a time, as a person watching the readout would
        handle.press("ArrowRight")
        expect(readout).to_have_text(str(value), timeout=10_000)
    back = rank_0_reads(live, "slider", 7)
    assert "ValueMesh({0: 7})" in back, f"the slider shows 7 in the browser; rank 0 reads {back!r}"
    # and the other way: set on the rank, moved in the browser
    live.run("%%monarch --targets 0\nslider.value = 2")
    expect(readout).to_have_text("2", timeout=10_000)
    shot(out, ARTIFACTS / "slider.png")
    assert not live.watch.problems[seen:], "\n".join(live.watch.problems[seen:])


@pytest.mark.timeout(240)
def test_a_ranks_widget_shows_again_after_the_page_is_reloaded(live):
    """A person reloads the page while the cluster is up: the rank's slider shows again, with
    the value set on the rank since and the one set in the browser, and still moves the value
    on the rank. (Last in the module: the page it leaves is a reloaded one.)"""
    from playwright.sync_api import expect

    shown = live.run(
        "%%monarch --targets 0\nimport ipywidgets\n"
        "kept = ipywidgets.IntSlider(value=4, min=0, max=10, description='kept')\ndisplay(kept)"
    )
    index = shown["index"]
    out = live.cell(index).locator(".jp-OutputArea")
    out.locator(".noUi-handle").click()
    out.locator(".noUi-handle").press("ArrowRight")  # 5, set in the browser
    expect(out.locator(".widget-readout")).to_have_text("5", timeout=10_000)
    live.run("%%monarch --targets 0\nkept.max = 20")  # set on the rank
    live.page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    live.page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000
    )
    seen = len(live.watch.problems)
    live.page.reload()
    live.page.wait_for_function(
        "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
        timeout=120_000,
    )
    out = live.cell(index).locator(".jp-OutputArea")
    handle = out.locator(".noUi-handle")
    try:
        handle.wait_for(timeout=30_000)
        readout = out.locator(".widget-readout")
        expect(readout).to_have_text("5", timeout=10_000)
        assert handle.get_attribute("aria-valuemax") in ("20", "20.0")
    finally:
        shot(out, ARTIFACTS / "slider-reloaded.png")
    handle.click()
    handle.press("ArrowRight")
    expect(readout).to_have_text("6", timeout=10_000)
    back = rank_0_reads(live, "kept", 6)
    assert "ValueMesh({0: 6})" in back, f"the slider shows 6 in the browser; rank 0 reads {back!r}"
    assert not live.watch.problems[seen:], "\n".join(live.watch.problems[seen:])


# a cell's rank widgets as the page shows them: live views, and the pictures left at down
RANK_WIDGETS_JS = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
  const out = cell && cell.outputArea.node;
  if (!out) return null;
  return {
    live: out.querySelectorAll('.widget-hprogress, .widget-slider').length,
    disabled: out.querySelectorAll('.widget-slider [disabled]').length,
    kept: out.querySelectorAll('.monarch-widget-static').length,
    bars: out.querySelectorAll('.monarch-widget-static .monarch-bar').length,
    text: out.innerText,
  };
}"""

ENDED = """\
%%monarch
import time
from tqdm.notebook import tqdm
for _ in tqdm(range(20), desc='ended'):
    time.sleep(0.02)
if rank == 0:
    import ipywidgets
    lr = ipywidgets.IntSlider(value=4, max=10, description='lr')
    display(lr)
    lr.value = 6
"""


@pytest.mark.timeout(300)
def test_at_down_the_ranks_bars_and_sliders_stay_and_the_saved_notebook_shows_them(live):
    """The tqdm bars and the slider a cell shows on ranks stay on the page when the cluster
    goes down, as they ended (the bars full, the slider at its last value, no longer live),
    and the notebook saved and opened again shows them. Those shown before the page was
    reloaded (the tests above), whose outputs the page no longer knows by display id, keep
    their views, disabled. (Last in the module: it takes the cluster down.)"""
    import nbformat

    cells = live.cells()
    earlier = [
        c["index"]
        for c in cells
        if "tqdm(range(30))" in c["source"] or "= ipywidgets" in c["source"]
    ]
    shown = live.run(ENDED)
    index = shown["index"]
    seen = len(live.watch.problems)
    before = live.page.evaluate(RANK_WIDGETS_JS, index)
    assert before["live"] == 3, before
    down = live.run("%monarch down", 120)
    assert "cluster shut down" in down["text"], down["text"]

    def ended(state: dict | None) -> str:
        """What is wrong with the cell's widgets as the page shows them after down."""
        if not state or state["live"] or state["kept"] != 3 or state["bars"] != 2:
            return f"not 2 bars and a slider, as pictures: {state}"
        if state["text"].count("20/20") != 2 or "lr" not in state["text"]:
            return f"not as they ended: {state['text']!r}"
        return ""

    live.page.wait_for_function(
        f"(i) => {{ const s = ({RANK_WIDGETS_JS})(i); return s && s.kept === 3; }}",
        arg=index,
        timeout=30_000,
    )
    shot(live.cell(index), ARTIFACTS / "rank-widgets-down.png")
    wrong = ended(live.page.evaluate(RANK_WIDGETS_JS, index))
    assert not wrong, wrong
    for i in earlier:  # still there, the sliders disabled
        state = live.page.evaluate(RANK_WIDGETS_JS, i)
        is_tqdm = "/30" in state["text"]
        assert state["live"] == (2 if is_tqdm else 1), (i, state)
        assert is_tqdm or state["disabled"], (i, state)
    shot(live.cell(earlier[-1]), ARTIFACTS / "rank-slider-down.png")
    problems = cell_problems([live.cells()[i] for i in [*earlier, index]])
    assert not problems + live.watch.problems[seen:], problems + live.watch.problems[seen:]

    live.page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    live.page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000
    )
    saved = nbformat.read(live.lab.root / live.name, as_version=4).cells[index]
    kinds = [sorted(o.get("data", {})) for o in saved.outputs if o.get("data")]
    assert kinds == [["text/html", "text/plain"]] * 3, kinds
    live.page.reload()
    live.page.wait_for_function(
        "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
        timeout=120_000,
    )
    live.page.wait_for_function(
        f"(i) => {{ const s = ({RANK_WIDGETS_JS})(i); return s && s.kept === 3; }}",
        arg=index,
        timeout=30_000,
    )
    shot(live.cell(index), ARTIFACTS / "rank-widgets-reopened.png")
    wrong = ended(live.page.evaluate(RANK_WIDGETS_JS, index))
    assert not wrong, f"opened again: {wrong}"
    problems = cell_problems([live.cells()[i] for i in [*earlier, index]])
    assert not problems, problems
