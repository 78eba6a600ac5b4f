"""32 CPU ranks in a real JupyterLab in headless Chromium, started once: ``%monarch status`` in a
row, the cell's output merged (identical lines once, numbers as a range, the rank that diverges
on a line of its own), the live panel in its compact form, and the sidebar grouped by host, a
host opening into a row per rank. How long the sidebar takes to draw is printed and written to
tests/artifacts/ranks-timing.txt with the screenshots (ranks-*.png): measured, not asserted."""

from __future__ import annotations

import time

import pytest
from _lab import ARTIFACTS, Lab, append_cell, chromium, requires_chromium

pytestmark = requires_chromium

RANKS = 32
NAME = "ranks.ipynb"
TRAIN = """\
%%monarch
import math, time
import monarch_nb
print("epoch 1")
for step in range(40):
    monarch_nb.log(step=step, loss=(3.0 if rank == 7 else 1.0) * math.exp(-step / 20))
    time.sleep(0.1)
print(f"loss {(3.0 if rank == 7 else 1.0) * math.exp(-2) + rank / 1000:.4f}")
print("stopping early: loss too high" if rank == 7 else "saved")
"""

OUTPUT_JS = """(index) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[index];
  if (!cell) return null;
  const out = cell.outputArea.node;
  const svg = out.querySelector('.monarch-panel svg');
  return {
    text: out.innerText,
    running: cell.model.executionState === 'running',
    panel: svg ? Array.from(svg.querySelectorAll('text')).map(t => t.textContent) : null,
    cells: svg ? svg.querySelectorAll('rect > title').length : 0,
  };
}"""

# the page's long tasks (over 50 ms of its main thread), from its first script on
LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver(list => {
  for (const e of list.getEntries()) window.__longTasks.push(e.duration);
}).observe({entryTypes: ['longtask']});
"""


def wait_output(page, index: int, test: str, timeout: float) -> dict:
    page.wait_for_function(f"(i) => {{ const o = ({OUTPUT_JS})(i); return o && ({test}); }}",
                           arg=index, timeout=timeout * 1000)  # fmt: skip
    return page.evaluate(OUTPUT_JS, index)


@pytest.mark.timeout(900)
def test_32_ranks_status_output_panel_and_sidebar_stay_readable(tmp_path):
    import nbformat
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    lab = Lab(tmp_path, expose_app=True)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, lab.root / NAME)
    timing = []
    try:
        lab.wait_ready()
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.add_init_script(LONG_TASKS)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab.url}/lab/tree/{NAME}?token={lab.token}")
            page.wait_for_function(
                "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
                timeout=120_000,
            )
            began = time.monotonic()
            up = append_cell(
                page, f"%load_ext monarch_nb\n%monarch up --workers {RANKS} --cpu --no-dist", True
            )
            shown = wait_output(page, up, f"!o.running && o.text.includes('{RANKS} ranks')", 300)
            timing.append(f"%monarch up --workers {RANKS}: {time.monotonic() - began:.1f} s")
            assert f"started {RANKS} ranks" in shown["text"], shown["text"]
            assert f"({RANKS} ranks in 1 row of ranks alike;" in shown["text"], shown["text"]

            status = append_cell(page, "%monarch status", True)
            text = wait_output(page, status, "!o.running && o.text.includes('ranks')", 60)["text"]
            lines = text.strip().splitlines()
            assert lines[0].split()[0] == "ranks" and lines[1].split()[0] == f"0-{RANKS - 1}"
            assert "idle" in lines[1] and len(lines) == 3, text

            train = append_cell(page, TRAIN, True)
            live = wait_output(page, train, "o.running && o.cells > 0", 120)
            assert f"running ranks 0-{RANKS - 1}" in " ".join(live["panel"]), live["panel"]
            page.wait_for_timeout(1500)  # some loss and samples in the picture
            assert live["cells"] == 2 * RANKS  # a utilization and a memory cell per rank
            page.evaluate(
                "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i]"
                ".outputArea.node.querySelector('.monarch-panel').scrollIntoView()",
                train,
            )
            page.screenshot(path=str(ARTIFACTS / "ranks-panel.png"))
            done = wait_output(page, train, "!o.running && o.text.includes('saved')", 240)
            out = done["text"]
            assert f"[ranks 0-{RANKS - 1}] epoch 1" in out, out
            assert f"[ranks 0-6,8-{RANKS - 1}] loss 0.1353..0.1663" in out, out
            assert "[rank 7] loss 0.4130" in out, out
            assert f"[ranks 0-6,8-{RANKS - 1}] saved" in out, out
            assert "[rank 7] stopping early: loss too high" in out, out
            assert "apart from the others: rank 7" in " ".join(done["panel"] or []), done

            # the sidebar: one host, closed, then opened into a row per rank
            page.evaluate("() => { window.__longTasks = []; }")  # the sidebar's only
            page.locator('.jp-SideBar [data-id="monarch-sidebar"]').click()
            sidebar = page.locator("#monarch-sidebar")
            hosts = sidebar.locator(".monarch-HostGroups .monarch-host")
            expect(hosts).to_have_count(1, timeout=60_000)
            expect(hosts.first).to_contain_text(f"{RANKS} ranks 0-{RANKS - 1}", timeout=30_000)
            expect(sidebar.locator(".monarch-BarChart-util")).to_be_hidden()
            expect(sidebar.locator(".monarch-host-ranks tbody tr")).to_have_count(0)
            closed = float(sidebar.locator(".monarch-HostGroups").get_attribute("data-render-ms"))
            opened_at = time.monotonic()
            hosts.first.locator("summary").click()
            rows = sidebar.locator(".monarch-host-ranks tbody tr")
            expect(rows).to_have_count(RANKS, timeout=30_000)
            took = 1000 * (time.monotonic() - opened_at)
            timing.append(f"sidebar: a host of {RANKS} opened and shown in {took:.0f} ms")
            page.wait_for_timeout(2000)  # a few polls with the host open
            open_ms = float(sidebar.locator(".monarch-HostGroups").get_attribute("data-render-ms"))
            long_tasks = page.evaluate("() => window.__longTasks")
            timing.append(
                f"sidebar update, hosts closed: {closed:.2f} ms; one open: {open_ms:.2f} ms"
            )
            timing.append(
                f"page long tasks (> 50 ms) while the sidebar showed: {len(long_tasks)}, "
                f"longest {max(long_tasks, default=0):.0f} ms"
            )
            sidebar.screenshot(path=str(ARTIFACTS / "ranks-sidebar.png"))

            down = append_cell(page, "%monarch down", True)
            wait_output(page, down, "!o.running", 120)
            assert not errors, errors
    finally:
        lab.stop()
        (ARTIFACTS / "ranks-timing.txt").write_text("\n".join(timing) + "\n")
        print("\n".join(timing))
