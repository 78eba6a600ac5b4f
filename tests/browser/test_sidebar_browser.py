"""The Monarch sidebar in a real JupyterLab, driven by headless Chromium (Debian's package,
through Python playwright; no browser download), with a real cluster started from a real
kernel. Screenshots land in tests/artifacts/."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest
from _lab import ARTIFACTS, Lab, chromium, requires_chromium
from _server_helpers import closed_port, register

from monarch_nb import registry

pytestmark = requires_chromium

START_CLUSTER = """\
import monarch_nb
%load_ext monarch_nb
%monarch up --workers 2 --cpu --no-dist
"""

TRAIN = """\
%%monarch
import math
import monarch_nb
monarch_nb.label(stage=f"s{rank}")  # a pipeline stage's name, shown under the rank
for step in range(40):
    monarch_nb.log(step=step, loss=2.0 * math.exp(-step / (8 + 8 * rank)))
"""
# What the live panel of a fault-tolerant cell publishes (telemetry/ft_feed.py), here written by
# hand: rank 1 lost at step 15 of the 40, its replacement healing from rank 0 at step 36
PUBLISH_FT = """\
import time
from monarch_nb.telemetry import ft_feed
now = time.time()
events = [
    {"time": now - 3, "rank": 1, "event": "lost", "step": 15, "participants": 1},
    {"time": now - 2, "rank": 1, "event": "joining", "step": None, "participants": None},
    {"time": now - 1, "rank": 1, "event": "healing", "step": 36, "participants": 1},
]
ft_feed.publish(monarch_nb.current().client, {
    "world": 2, "participants": [[0, 2], [15, 1], [39, 1]], "lost": [[15, 1]],
    "events": events, "away": [{"rank": 1, "state": "healing", "step": 36}], "back": [],
})
"""
# the x of the loss plot and of the participants plot under it, in the page
PLOTS_X = """() => ['.monarch-loss-plot', '.monarch-ft-plot'].map(s => {
  const b = document.querySelector('#monarch-sidebar ' + s).getBoundingClientRect();
  return [b.x, b.width];
})"""


class Kernel:
    """A notebook session's kernel on the lab server, driven through its connection file."""

    def __init__(self, lab: Lab, notebook: str):
        import nbformat
        from jupyter_client import BlockingKernelClient

        nbformat.write(nbformat.v4.new_notebook(), lab.root / notebook)
        session = lab.api(
            "api/sessions",
            "POST",
            {"path": notebook, "name": notebook, "type": "notebook", "kernel": {"name": "python3"}},
        )
        self.lab, self.session = lab, session["id"]
        self.id = session["kernel"]["id"]
        connection = lab.runtime / f"kernel-{self.id}.json"
        deadline = time.monotonic() + 30
        while not connection.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.client = BlockingKernelClient(connection_file=str(connection))
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 240) -> str:
        out: list[str] = []

        def hook(msg):
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(content["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", f"{code!r} failed:\n{text}"
        return text

    def close(self) -> None:
        self.client.stop_channels()
        self.lab.api(f"api/sessions/{self.session}", "DELETE")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("lab"))
    try:
        lab.wait_ready()
        yield lab
    finally:
        lab.stop()


@pytest.fixture(scope="module")
def kernel(lab):
    kernel = Kernel(lab, "monarch-demo.ipynb")
    yield kernel
    kernel.close()


def test_the_sidebar_lists_the_cluster_with_a_bar_per_rank_and_a_loss_line(lab, kernel):
    from playwright.sync_api import expect

    with urllib.request.urlopen(f"{lab.url}/lab?token={lab.token}", timeout=30) as r:
        assert b"monarch-nb" in r.read(), (
            "the monarch-nb labextension is not installed (pip install -e .)"
        )
    printed = kernel.run(START_CLUSTER)
    assert "2 ranks" in printed, printed
    kernel.run(TRAIN)
    clusters = lab.api("monarch/api/clusters")["clusters"]
    assert len(clusters) == 1, (
        f"expected the kernel's cluster in the registry (Controller registers it), got {clusters}"
    )
    cluster = clusters[0]
    assert cluster["kernel_id"] == kernel.id
    assert cluster["notebook"] == "monarch-demo.ipynb"

    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.goto(f"{lab.url}/lab?token={lab.token}")
        tab = page.locator('.jp-SideBar [data-id="monarch-sidebar"]')
        expect(tab).to_be_visible(timeout=60_000)
        tab.click()
        sidebar = page.locator("#monarch-sidebar")
        item = sidebar.locator(f'.monarch-cluster[data-id="{cluster["id"]}"]')
        expect(item).to_contain_text("monarch-demo.ipynb", timeout=30_000)
        expect(item).to_contain_text(cluster["scheduler_address"])
        expect(item).to_contain_text("2 ranks")
        util = sidebar.locator(".monarch-BarChart-util .monarch-bar")
        expect(util).to_have_count(2, timeout=30_000)
        expect(sidebar.locator(".monarch-BarChart-mem .monarch-bar")).to_have_count(2)
        expect(util.nth(0)).to_contain_text("rank 0")
        expect(util.nth(1)).to_contain_text("rank 1")
        lines = sidebar.locator(".monarch-loss-line")
        expect(lines).to_have_count(2, timeout=30_000)
        for i in range(2):
            points = lines.nth(i).get_attribute("points") or ""
            assert len(points.split()) == 40, points
        expect(sidebar.locator(".monarch-RankTable tbody tr")).to_have_count(2)
        labels = sidebar.locator(".monarch-RankTable .monarch-rank-labels")
        expect(labels).to_have_text(["stage=s0", "stage=s1"], timeout=30_000)
        expect(sidebar.locator(".monarch-RankTable")).to_contain_text("running")
        expect(sidebar.locator(".monarch-ParticipantsChart")).to_be_hidden()  # no --ft
        page.screenshot(path=str(ARTIFACTS / "sidebar.png"))

        # a fault-tolerant cell's rank on its way back: its state in the table, the loss's
        # mark at the step it was lost, the participants per step under the loss, on its steps
        kernel.run(PUBLISH_FT)
        state = sidebar.locator('.monarch-RankTable tr[data-rank="1"] .monarch-state')
        expect(state).to_have_text("healing", timeout=30_000)
        expect(sidebar.locator(".monarch-loss-plot .monarch-ft-mark")).to_have_count(1)
        expect(sidebar.locator(".monarch-ParticipantsChart")).to_be_visible()
        expect(sidebar.locator(".monarch-ft-fewer")).to_have_count(1)
        expect(sidebar.locator(".monarch-ft-event")).to_have_text(
            [
                "rank 1 lost at step 15; 1 of 2 go on",
                "rank 1 joining: its replacement runs the setup cells",
                "rank 1 healing from a peer at step 36",
            ]
        )
        loss_x, ft_x = page.evaluate(PLOTS_X)
        assert loss_x == pytest.approx(ft_x, abs=1), (loss_x, ft_x)
        sidebar.locator(".monarch-ParticipantsChart").scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "sidebar-ft.png"))
        assert not errors, errors

        # the dashboard page, through the server's proxy, in a main-area tab
        sidebar.locator(".monarch-button-dashboard").click()
        frame = page.frame_locator(f"#monarch-dashboard-{cluster['id']} iframe")
        expect(frame.locator(".bk-Canvas, canvas").first).to_be_visible(timeout=60_000)
        page.wait_for_timeout(2500)  # a poll of figures.json or two
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"))

        # shutting it down asks first; cancelling leaves it up
        shutdown = sidebar.locator(".monarch-button-shutdown")
        shutdown.click()
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text("Shut the cluster down?")
        dialog.locator(".jp-mod-reject").click()
        expect(dialog).to_have_count(0)

        # the scheduler dies while the kernel lives on: the sidebar says so, no spinner
        kernel.run("monarch_nb.current().cluster.close()")
        detail = sidebar.locator(".monarch-ClusterDetail")
        expect(detail).to_have_attribute("data-state", "gone", timeout=20_000)
        expect(detail.locator(".monarch-detail-status")).to_contain_text("does not answer")
        page.screenshot(path=str(ARTIFACTS / "sidebar-gone.png"))
        expect(shutdown).to_have_text("Forget")
        shutdown.click()
        expect(dialog).to_contain_text("Forget the cluster?")
        dialog.locator(".jp-mod-warn").click()
        expect(item).to_have_count(0, timeout=30_000)
        expect(sidebar.locator(".monarch-ClusterList .monarch-empty")).to_be_visible()

        # a kept cluster no kernel holds: listed as detached, and shut down from here
        kernel.run(
            "monarch_nb.up(workers=1, cpu=True, dist=False, keep='10m', name='kept-demo', "
            "current=False).detach()"
        )
        kept = sidebar.locator('.monarch-kept:has-text("kept-demo")')
        expect(kept).to_contain_text("kept-demo · detached", timeout=30_000)
        expect(kept).to_contain_text("1 rank")
        page.screenshot(path=str(ARTIFACTS / "sidebar-detached.png"))
        kept.locator(".monarch-kept-shutdown").click()
        expect(dialog).to_contain_text("Shut kept-demo down?")
        dialog.locator(".jp-mod-warn").click()
        expect(kept).to_have_count(0, timeout=30_000)
    assert lab.api("monarch/api/kept")["kept"] == []
    assert lab.api("monarch/api/clusters")["clusters"] == []


def test_a_live_cluster_the_server_cannot_reach_is_named_with_why(lab, monkeypatch):
    """A live controller whose dashboard never answered this server (here: this process, with a
    port nothing listens on) is not listed to wait on; one line says whose it is and why."""
    from playwright.sync_api import expect

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(lab.runtime))
    port = closed_port()
    cluster_id = register(f"http://127.0.0.1:{port}/status", f"tcp://127.0.0.1:{port}")
    try:
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # a workspace of its own: the sidebar starts closed, whatever the test above left
            page.goto(f"{lab.url}/lab/workspaces/unreachable?token={lab.token}")
            tab = page.locator('.jp-SideBar [data-id="monarch-sidebar"]')
            expect(tab).to_be_visible(timeout=60_000)
            tab.click()
            sidebar = page.locator("#monarch-sidebar")
            line = sidebar.locator(".monarch-unreachable-item")
            expect(line).to_be_visible(timeout=30_000)
            expect(line).to_contain_text(
                f"process {os.getpid()}: not shown: the scheduler's dashboard at "
                f"http://127.0.0.1:{port}/ does not answer",
                timeout=30_000,
            )
            expect(sidebar.locator(".monarch-cluster")).to_have_count(0)
            expect(sidebar.locator(".monarch-ClusterList .monarch-empty")).to_be_hidden()
            page.screenshot(path=str(ARTIFACTS / "sidebar-unreachable.png"))
    finally:
        registry.unregister(cluster_id)
