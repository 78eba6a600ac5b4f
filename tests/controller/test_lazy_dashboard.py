"""A local cluster's scheduler makes Dask's Bokeh dashboard when it is first asked for, not as
it starts (controller/lazy_dashboard.py): our routes answer without it, and every page of Dask's
answers as before, the first one included."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from monarch_nb.controller import cluster as clusters
from monarch_nb.controller.lazy_dashboard import LazyDashboard
from monarch_nb.telemetry import dashboard


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.geturl(), r.read()
    except urllib.error.HTTPError as e:
        return e.code, url, b""


def _bokeh_apps(scheduler) -> list:
    return [a for a in scheduler.http_application.applications if not isinstance(a, LazyDashboard)]


async def _pages(paths: list[str]) -> tuple[list, list, list]:
    local_scheduler = clusters._scheduler_class()
    async with local_scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0") as s:
        await dashboard.DashboardPlugin().start(s)
        base = f"http://127.0.0.1:{s.http_server.port}"
        before = _bokeh_apps(s)
        got = []
        for path in paths:
            status, url, body = await asyncio.to_thread(_get, base + path)
            got.append((status, url.removeprefix(base), body))
            if path == "/monarch/metrics.json":
                assert not _bokeh_apps(s), "our route made Dask's dashboard"
        return before, _bokeh_apps(s), got


def test_dask_dashboard_is_made_at_its_first_request():
    paths = ["/monarch/metrics.json", "/health", "/status", "/", "/workers", "/no-such-page"]
    before, after, got = asyncio.run(_pages(paths))
    assert before == []
    assert len(after) == 1  # made once, for the first page of its own
    answers = dict(zip(paths, got, strict=True))
    assert answers["/monarch/metrics.json"][0] == 200
    assert answers["/health"][:1] == (200,) and answers["/health"][2] == b"ok"
    status, _, body = answers["/status"]
    assert status == 200 and b"bokeh" in body.lower()  # the first request is the dashboard's
    assert answers["/"][:2] == (200, "/status")  # its root redirects, as Dask's does
    assert answers["/workers"][0] == 200
    assert answers["/no-such-page"][0] == 404


@pytest.mark.parametrize("first", ["/status", "/individual-task-stream"])
def test_any_dashboard_page_first_is_answered(first):
    _, after, got = asyncio.run(_pages([first]))
    assert len(after) == 1 and got[0][0] == 200 and b"bokeh" in got[0][2].lower()
