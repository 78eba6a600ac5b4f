"""A notebook in JupyterLab, driven through its commands from playwright, and the checks for
what a person would see as broken in it: error outputs, JavaScript and widget errors shown in
outputs, console and page errors, requests to hosts other than 127.0.0.1, blank bokeh canvases.
Used by the browser tests (the Lab must expose ``window.jupyterapp``)."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

from _lab import ARTIFACTS, Lab, append_cell

ERROR_TEXTS = (
    "Javascript Error",
    "Click to show javascript error",
    "Error displaying widget",
    "Failed to create view",
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A line of Dask's own logging ("2026-12-01 15:38:57,297 - distributed.nanny - WARNING - ..."):
# the README promises that what Dask logs never reaches a cell.
DASK_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - distributed\.\S+ - \w+ - .*$", re.M)
QUIET = 10  # seconds with the kernel idle and no cell running: a run that sends no more cells

PROGRESS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const code = panel.content.widgets.filter(c => c.model.type === 'code');
  return {
    command: window.__testCommand,
    kernel: panel.sessionContext.session?.kernel?.status ?? 'none',
    running: code.filter(c => c.model.executionState === 'running').length,
    unrun: code.filter(c => c.model.executionCount === null).length,
  };
}"""

# The notebook panel's cells as data: what the model holds and what the page shows. Each
# cell's node is tagged so that Python can locate it; `figures` are bokeh plots (bk-Canvas,
# found through shadow roots), each tagged for an element screenshot.
CELLS_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const deep = (root, pick, found = []) => {
    for (const el of root.querySelectorAll('*')) {
      if (pick(el)) found.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, pick, found);
    }
    return found;
  };
  let fig = 0;
  return nb.widgets.map((cell, index) => {
    cell.node.setAttribute('data-test-cell', String(index));
    const out = cell.model.type === 'code' ? cell.outputArea.node : null;
    const figures = out ? deep(out, el => el.classList.contains('bk-Canvas')) : [];
    return {
      index,
      type: cell.model.type,
      source: cell.model.sharedModel.getSource(),
      tags: cell.model.getMetadata('tags') || [],
      count: cell.model.type === 'code' ? cell.model.executionCount : null,
      outputs: cell.model.type === 'code' ? cell.model.outputs.toJSON() : [],
      text: out ? out.innerText : '',
      figures: figures.map(el => {
        el.setAttribute('data-test-figure', String(fig));
        const box = el.getBoundingClientRect();
        return {id: fig++, width: box.width, height: box.height};
      }),
    };
  });
}"""

# A chart area: the union of the drawn things (canvas, svg) in a cell's output.
CHART_BOX_JS = """(index) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[index];
  const deep = (root, found = []) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'CANVAS' || el.tagName === 'svg') found.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, found);
    }
    return found;
  };
  const boxes = deep(cell.outputArea.node)
    .map(el => el.getBoundingClientRect())
    .filter(b => b.width >= 80 && b.height >= 40);
  if (!boxes.length) return null;
  const x = Math.min(...boxes.map(b => b.left)), y = Math.min(...boxes.map(b => b.top));
  const right = Math.max(...boxes.map(b => b.right));
  const bottom = Math.max(...boxes.map(b => b.bottom));
  return {x, y, width: right - x, height: bottom - y};
}"""


class Watch:
    """What the page reports that a person would see as broken: console errors, page errors,
    and requests (or websockets) to any host but 127.0.0.1."""

    def __init__(self, page):
        self.problems: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on("request", lambda request: self._url(request.url, f"{request.method} request"))
        page.on("websocket", lambda ws: self._url(ws.url, "websocket"))

    def _console(self, message) -> None:
        if message.type == "error":
            where = message.location or {}
            self.problems.append(
                f"console error: {message.text} "
                f"(at {where.get('url', '?')}:{where.get('lineNumber', '?')})"
            )

    def _url(self, url: str, what: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("data", "blob", "about") and parts.hostname != "127.0.0.1":
            self.problems.append(f"{what} to a host other than 127.0.0.1: {url}")


class NotebookPage:
    """A notebook opened in JupyterLab in a page of its own (its own workspace), driven through
    JupyterLab's commands (``window.jupyterapp``)."""

    def __init__(self, browser, lab: Lab, name: str):
        self.lab, self.name = lab, name
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.watch = Watch(self.page)
        workspace = re.sub(r"\W", "-", Path(name).stem)
        self.page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{name}?token={lab.token}")
        self.page.wait_for_function(
            "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
            timeout=120_000,
        )
        # the file browser closed: room for a row of figures, as a reader would make it
        self.page.evaluate(
            """async () => {
              window.jupyterapp.shell.collapseLeft();
              await window.jupyterapp.shell.currentWidget.sessionContext.ready;
            }"""
        )
        self.wait_idle(60)

    def wait_idle(self, timeout: float) -> None:
        self.page.wait_for_function(
            "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
            " === 'idle'",
            timeout=timeout * 1000,
        )

    def command(self, name: str, timeout: float) -> None:
        """Run a JupyterLab command that runs cells, and wait until every code cell has run
        and the kernel is idle, or nothing has run for QUIET seconds (a cell the kernel
        aborted never gets a count; the checks then name it)."""
        self.page.evaluate(
            """(name) => {
              window.__testCommand = 'running';
              window.jupyterapp.commands.execute(name).then(
                () => { window.__testCommand = 'done'; },
                (e) => { window.__testCommand = 'failed: ' + e; });
            }""",
            name,
        )
        deadline = time.monotonic() + timeout
        quiet_since = None
        while True:
            # Run All sends the cells one after another, and its promise settles early when
            # a `raises-exception` cell fails: watch the cells, not the command.
            state = self.page.evaluate(PROGRESS_JS)
            assert not state["command"].startswith("failed"), (
                f"{self.name}: JupyterLab's {name} {state['command']}"
            )
            now = time.monotonic()
            settled = not state["running"] and state["kernel"] == "idle"
            if settled and not state["unrun"]:
                return
            quiet_since = (quiet_since or now) if settled else None
            if quiet_since is not None and now - quiet_since > QUIET:
                return
            assert now < deadline, f"{self.name}: cells still running after {timeout} s: {state}"
            time.sleep(0.5)

    def append(self, source: str) -> int:
        """A new code cell at the end, selected; its index."""
        return append_cell(self.page, source)

    def run(self, source: str, timeout: float = 120) -> dict:
        """Run ``source`` as a new cell; the cell as CELLS_JS describes it."""
        return self.run_cell(self.append(source), timeout)

    def run_cell(self, index: int, timeout: float = 120) -> dict:
        """Run the cell at ``index``; the cell as CELLS_JS describes it."""
        self.page.evaluate(
            """(i) => {
              const nb = window.jupyterapp.shell.currentWidget.content;
              nb.activeCellIndex = i;
              nb.deselectAll();
            }""",
            index,
        )
        self.command("notebook:run-cell", timeout)
        return self.cells()[index]

    def start(self, source: str) -> int:
        """Start ``source`` as a new cell without waiting for it; its index."""
        index = self.append(source)
        self.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-cell'); }")
        return index

    def cells(self) -> list[dict]:
        return self.page.evaluate(CELLS_JS)

    def cell(self, index: int):
        """The cell's node, for locators and screenshots."""
        self.page.evaluate(
            """(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node
                 .setAttribute('data-test-cell', String(i))""",
            index,
        )
        return self.page.locator(f'[data-test-cell="{index}"]')

    def shut_down(self, settle: float = 2) -> None:
        """Shut the kernel down from the page and close the notebook, as a person does once
        done, and wait ``settle`` seconds: what the page's widgets do as their kernel goes and
        their views are detached (a figure sending its new size, say) lands in ``watch``."""
        self.page.evaluate(
            """async () => {
              const panel = window.jupyterapp.shell.currentWidget;
              await panel.sessionContext.shutdown();
              panel.dispose();
            }"""
        )
        self.page.wait_for_timeout(settle * 1000)

    def close(self) -> None:
        self.page.close()
        for session in self.lab.api("api/sessions"):
            if session["path"] == self.name:
                self.lab.api(f"api/sessions/{session['id']}", "DELETE")


def shot(locator, path: Path | None = None) -> bytes:
    """An element's screenshot, taken once the notebook has scrolled it into view (taken while
    it scrolls, the picture is cut)."""
    locator.scroll_into_view_if_needed()
    locator.page.wait_for_timeout(300)
    return locator.screenshot(path=None if path is None else str(path))


def blank_fraction(png: bytes) -> float:
    """The share of pixels in the most common colour (1.0: nothing drawn)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colors = image.getcolors(maxcolors=image.width * image.height)
    return max(colors)[0] / (image.width * image.height)


def figure_problems(nbpage: NotebookPage, cells: list[dict], stem: str) -> list[str]:
    """A figure is drawn when its canvas has non-blank pixels; each one's screenshot is kept."""
    problems = []
    for cell in cells:
        wanted = sum(1 for out in cell["outputs"] if wants_figure(out))
        drawn = 0
        for fig in cell["figures"]:
            where = f"cell {cell['index']} ({first_line(cell)}): bokeh figure {fig['id']}"
            if fig["width"] < 10 or fig["height"] < 10:
                problems.append(f"{where} has no size ({fig['width']}x{fig['height']} px)")
                continue
            element = nbpage.page.locator(f'[data-test-figure="{fig["id"]}"]')
            png = shot(element, ARTIFACTS / f"{stem}-figure{fig['id']}.png")
            if blank_fraction(png) > 0.99:
                problems.append(f"{where}: its canvas is blank ({stem}-figure{fig['id']}.png)")
            else:
                drawn += 1
        if wanted and not cell["figures"]:
            problems.append(
                f"cell {cell['index']} ({first_line(cell)}): {wanted} bokeh output(s) and no "
                "figure in the page (BokehJS not loaded?)"
            )
    return problems


def wants_figure(output: dict) -> bool:
    data = output.get("data") or {}
    if "application/vnd.bokehjs_exec.v0+json" in data:
        return True
    return "application/vnd.jupyter.widget-view+json" in data and "BokehModel(" in str(
        data.get("text/plain", "")
    )


def plain(cell: dict) -> str:
    """What the cell's outputs say as text (streams and text/plain), as a kernel client reads
    them; the page may show a rich form instead."""
    parts = []
    for out in cell["outputs"]:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(str(out["data"].get("text/plain", "")))
    return "".join(parts)


def first_line(cell: dict) -> str:
    return repr(cell["source"].splitlines()[0] if cell["source"] else "")


def cell_problems(cells: list[dict], finished: bool = True) -> list[str]:
    """What the cells show broken; ``finished=False`` for cells still running."""
    problems = []
    for cell in cells:
        if cell["type"] != "code":
            continue
        where = f"cell {cell['index']} ({first_line(cell)})"
        if finished and cell["count"] is None:
            problems.append(f"{where} never ran")
        for out in cell["outputs"]:
            if out["output_type"] == "error" and "raises-exception" not in cell["tags"]:
                trace = ANSI.sub("", "\n".join(out.get("traceback") or []))
                problems.append(f"{where} raised {out['ename']}: {out['evalue']}\n{trace[-1500:]}")
        streams = "".join(o["text"] for o in cell["outputs"] if o["output_type"] == "stream")
        for line in DASK_LOG.findall(streams):
            problems.append(f"{where} shows Dask's own log line: {line!r}")
        for text in ERROR_TEXTS:
            if text in cell["text"]:
                at = cell["text"].index(text)
                shown = cell["text"][max(0, at - 100) : at + 300].strip()
                problems.append(f"{where} shows {text!r}: {shown!r}")
    return problems
