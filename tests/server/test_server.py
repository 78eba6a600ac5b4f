"""The sidebar's server side against a real Jupyter server (pytest-jupyter), real Dask
schedulers and the registry in a temporary Jupyter runtime directory."""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.request
import uuid

import pytest
import tornado.web
from _server_helpers import (
    NO_TOKEN,
    closed_port,
    dead_pid,
    fake_controller,
    register,
    serve,
    status_of,
)
from tornado.httpclient import HTTPClientError

from monarch_nb import registry
from monarch_nb.telemetry import dashboard, figures, metrics
from monarch_nb.telemetry import store as metrics_store

pytest_plugins = ["pytest_jupyter.jupyter_server"]


# -- the registry -----------------------------------------------------------------------------
def test_register_writes_an_owner_only_entry_and_unregister_removes_it(runtime):
    ctl = fake_controller("http://127.0.0.1:8787/status", "tcp://127.0.0.1:8786")
    path = registry.register(ctl)
    assert path == runtime / "monarch-clusters" / f"{ctl.id}.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    entry = json.loads(path.read_text())
    assert entry["id"] == ctl.id
    assert entry["scheduler_address"] == "tcp://127.0.0.1:8786"
    assert entry["dashboard_url"] == "http://127.0.0.1:8787/"
    assert entry["ranks"] == 2
    assert entry["pid"] == os.getpid()
    assert abs(entry["started"] - time.time()) < 60
    assert entry["kernel_id"] is None  # pytest is not a kernel
    assert [e["id"] for e in registry.list_entries()] == [ctl.id]
    assert registry.unregister(ctl) is True
    assert registry.list_entries() == []
    assert registry.unregister(ctl.id) is False


def test_register_refuses_a_registry_directory_that_is_a_symlink(runtime, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    runtime.mkdir(parents=True)
    (runtime / "monarch-clusters").symlink_to(elsewhere)
    assert registry.register(fake_controller()) is None
    assert "cannot record the cluster" in caplog.text
    assert list(elsewhere.iterdir()) == []
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_register_skips_a_cluster_the_server_could_not_reach(runtime, caplog):
    ctl = fake_controller(None, "inproc://127.0.0.1/4242/1")
    assert registry.register(ctl) is None
    assert "the JupyterLab sidebar will not list this cluster: scheduler_address" in caplog.text
    assert not (runtime / "monarch-clusters" / f"{ctl.id}.json").exists()


def test_entries_of_dead_or_reused_pids_are_pruned(runtime):
    live = register()
    dead = register()
    reused = register()
    folder = runtime / "monarch-clusters"
    for cluster_id, change in ((dead, {"pid": dead_pid()}), (reused, {"pid_started": 1.0})):
        entry = json.loads((folder / f"{cluster_id}.json").read_text())
        entry.update(change)
        registry.write_entry(entry)
    junk = folder / f"{uuid.uuid4().hex}.json"
    junk.write_text("{not json")
    junk.chmod(0o600)
    assert [e["id"] for e in registry.list_entries(prune=False)] == [live]
    assert len(list(folder.iterdir())) == 4  # without prune, nothing is deleted
    assert [e["id"] for e in registry.list_entries()] == [live]
    # the junk is not a stale entry but an untrusted one: left for its owner to look at
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{live}.json", junk.name])


def test_a_real_controller_registers_its_cluster_until_down(runtime):
    import monarch_nb

    ctl = monarch_nb.up(workers=1, cpu=True, dist=False, current=False)
    try:
        (entry,) = registry.list_entries()
        assert entry["id"] == ctl.id and entry["ranks"] == 1
        assert entry["scheduler_address"] == ctl.scheduler_address
        assert entry["dashboard_url"] == registry.dashboard_base(ctl.client.dashboard_link)
        # the controller put the dashboard routes on its scheduler
        with urllib.request.urlopen(entry["dashboard_url"] + "monarch/metrics.json") as r:
            assert json.loads(r.read())["workers"][0]["name"] == 0
    finally:
        ctl.down()
    assert registry.list_entries() == []


def test_kernel_id_comes_from_the_connection_file(monkeypatch):
    import ipykernel.connect

    kid = "0b7c5f3e-6a8e-4c1e-9d44-0c7b2e9a1f00"
    monkeypatch.setattr(
        ipykernel.connect, "get_connection_file", lambda: f"/run/jupyter/kernel-{kid}.json"
    )
    assert registry.kernel_id() == kid
    monkeypatch.setattr(ipykernel.connect, "get_connection_file", lambda: "/tmp/other.json")
    assert registry.kernel_id() is None


def test_ids_and_dashboard_urls_are_checked():
    assert registry.valid_id(uuid.uuid4().hex)
    for bad in ("", "../../etc/passwd", "A" * 32, uuid.uuid4().hex + "0", "g" * 32):
        assert not registry.valid_id(bad)
    with pytest.raises(ValueError, match="32 hex digits"):
        registry.write_entry({"id": "../x"})
    assert registry.dashboard_base("http://10.0.0.5:8787/status") == "http://10.0.0.5:8787/"
    assert registry.dashboard_base("file:///etc/passwd") is None
    assert registry.dashboard_base(None) is None
    # recorded only where the scheduler's own host serves it (readers refuse any other)
    scheduler = "tcp://10.0.0.5:8786"
    assert registry.dashboard_for("http://10.0.0.5:8787/status", scheduler) == (
        "http://10.0.0.5:8787/"
    )
    assert registry.dashboard_for("https://hub.example/user/a/proxy/8787/status", scheduler) is None
    assert registry.dashboard_for("http://[::1]:8787/status", "tcp://[::1]:8786") == (
        "http://[::1]:8787/"
    )


# -- authentication ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method, route",
    [
        ("GET", "clusters"),
        ("GET", "clusters/{id}"),
        ("GET", "clusters/{id}/metrics"),
        ("DELETE", "clusters/{id}"),
    ],
)
async def test_api_without_a_token_is_403(jp_fetch, runtime, method, route):
    cluster_id = register()
    parts = ["monarch", "api", *route.format(id=cluster_id).split("/")]
    code, _ = await status_of(jp_fetch, *parts, method=method, headers=NO_TOKEN)
    assert code == 403
    code, _ = await status_of(
        jp_fetch, *parts, method=method, headers={"Authorization": "token wrong"}
    )
    assert code == 403
    assert registry.get_entry(cluster_id) is not None  # nothing happened to it


async def test_proxy_without_a_token_is_403(jp_fetch, runtime, page_server):
    url, hits = page_server
    cluster_id = register(url + "status")
    code, _ = await status_of(jp_fetch, "monarch", "proxy", cluster_id, "page", headers=NO_TOKEN)
    assert code == 403
    assert hits == []


# -- listing ----------------------------------------------------------------------------------
async def test_list_shows_live_entries_and_drops_stale_ones(jp_fetch, runtime, page_server):
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert (code, body) == (200, {"clusters": [], "unreachable": []})
    url, _ = page_server
    live = register(url + "status", f"tcp://127.0.0.1:{url.rsplit(':', 1)[1].strip('/')}")
    stale = register()
    path = runtime / "monarch-clusters" / f"{stale}.json"
    entry = json.loads(path.read_text())
    entry["pid"] = dead_pid()
    registry.write_entry(entry)
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert code == 200
    (row,) = body["clusters"]
    assert row["id"] == live
    assert row["dashboard_url"] == url
    assert row["ranks"] == 2 and row["notebook"] is None
    assert not path.exists()
    # a stale id is then unknown everywhere
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", stale, "metrics")
    assert code == 404 and stale in body["message"]


@pytest.mark.parametrize("suffix", ["", "/metrics"])
async def test_unknown_and_malformed_ids(jp_fetch, runtime, suffix):
    unknown = uuid.uuid4().hex
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", unknown + suffix)
    assert code == 404
    assert f"no cluster with id {unknown}" in body["message"]
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", "not-an-id" + suffix)
    assert code == 400
    assert "malformed cluster id" in body["message"]
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", unknown, method="DELETE")
    assert code == 404


# -- a scheduler that is gone -----------------------------------------------------------------
async def test_a_dead_scheduler_is_reported_gone_quickly(jp_fetch, runtime):
    port = closed_port()
    cluster_id = register(f"http://127.0.0.1:{port}/status", f"tcp://127.0.0.1:{port}")
    start = time.monotonic()
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
    assert code == 410
    assert body["state"] == "gone" and body["id"] == cluster_id
    assert f"127.0.0.1:{port}" in body["message"]
    code, body = await status_of(jp_fetch, "monarch", "proxy", cluster_id, "monarch")
    assert code == 410
    # shutting it down still forgets it, and says the scheduler did not answer
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
    )
    assert code == 200 and body["closed"] is False
    assert registry.get_entry(cluster_id) is None
    assert time.monotonic() - start < 15


# -- the proxy --------------------------------------------------------------------------------
@pytest.fixture
def page_server(jp_asyncio_loop):
    """A small web server standing in for a dashboard; ``hits`` lists every path it served."""
    hits: list[str] = []

    class Page(tornado.web.RequestHandler):
        def get(self, path):
            hits.append(self.request.uri)
            if path == "old":
                self.redirect("/page")
                return
            self.set_header("Content-Type", "text/html")
            self.write(f"<p>dashboard {path} {self.get_argument('x', '')}</p>")

    url, server = serve(tornado.web.Application([(r"/(.*)", Page)]))
    yield url, hits
    server.stop()


async def test_proxy_forwards_to_the_registered_dashboard_only(jp_fetch, runtime, page_server):
    url, hits = page_server
    cluster_id = register(url + "status")
    response = await jp_fetch("monarch", "proxy", cluster_id, "page/a.html", params={"x": "1"})
    assert response.code == 200
    assert response.headers["Content-Type"] == "text/html"
    assert response.body.decode() == "<p>dashboard page/a.html 1</p>"
    assert hits == ["/page/a.html?x=1"]
    # a redirect on the dashboard stays below the proxy
    with pytest.raises(HTTPClientError) as caught:
        await jp_fetch("monarch", "proxy", cluster_id, "old", follow_redirects=False)
    response = caught.value.response
    assert response.code == 302
    assert response.headers["Location"] == f"/a%40b/monarch/proxy/{cluster_id}/page"
    # an unregistered id is refused before any request is made
    hits.clear()
    code, _ = await status_of(jp_fetch, "monarch", "proxy", uuid.uuid4().hex, "page")
    assert code == 404
    code, _ = await status_of(jp_fetch, "monarch", "proxy", "127.0.0.1:8787", "page")
    assert code == 400
    assert hits == []


@pytest.mark.parametrize(
    "path",
    [
        "../../api/contents",
        "a/../../../etc/passwd",
        "%2e%2e/%2e%2e/api",
        "a/%2e%2e/b",
        "./page",
        "a//b",
        "%2Fetc%2Fpasswd",
        "a%5Cb",
        "http:%2F%2Fevil.example%2F",
        "page%00",
    ],
)
async def test_proxy_refuses_traversal(
    jp_fetch, jp_serverapp, http_server_client, runtime, page_server, path
):
    url, hits = page_server
    cluster_id = register(url + "status")
    token = jp_serverapp.identity_provider.token
    # sent raw: the test client must not normalise the path first
    try:
        response = await http_server_client.fetch(
            f"/a%40b/monarch/proxy/{cluster_id}/{path}",
            headers={"Authorization": f"token {token}"},
            raise_error=False,
        )
        code = response.code
    except HTTPClientError as e:
        code = e.code
    assert code == 400  # refused by the proxy itself, not by a failed route
    assert hits == []


# -- a real scheduler: metrics and shutdown ---------------------------------------------------
def batch(rank: int, steps: int) -> dict:
    now = time.time()
    return {
        "rank": rank,
        "worker": str(rank),
        "host": "node-a",
        "scalars": [[i, now + i, {"loss": 2.0 / (i + 1 + rank)}] for i in range(steps)],
        "samples": [
            {
                "rank": rank,
                "host": "node-a",
                "time": now,
                "device": "AMD Instinct MI300X",
                "kind": "rocm",
                "util": 40.0 + rank,
                "mem_used": 8 * 2**30,
                "mem_total": 192 * 2**30,
                "power": None,
                "temp": None,
                "cpu": 12.0,
                "rss": 2**30,
            }
        ],
        "dropped": 0,
    }


@pytest.fixture
def scheduler(jp_asyncio_loop):
    """A real Dask scheduler on the test's loop with the dashboard routes and the metrics
    store (no workers: the store is fed the batches workers would send)."""
    from distributed import Scheduler

    async def start():
        s = await Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0")
        await dashboard.DashboardPlugin().start(s)
        s.add_plugin(metrics_store.MetricsStore(), name=metrics.SCHEDULER_PLUGIN)
        for rank in (0, 1):
            s.log_event(metrics.TOPIC, batch(rank, 30))
        return s

    s = jp_asyncio_loop.run_until_complete(start())
    yield s
    jp_asyncio_loop.run_until_complete(s.close())


def scheduler_entry(s, owns_cluster=True) -> str:
    port = s.http_server.port
    return register(f"http://127.0.0.1:{port}/status", s.address, owns_cluster)


async def test_metrics_of_a_live_cluster(jp_fetch, runtime, scheduler):
    cluster_id = scheduler_entry(scheduler)
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
    assert code == 200, body
    assert body["state"] == "up" and body["id"] == cluster_id
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    r1 = body["ranks"][1]
    assert r1["device"] == "AMD Instinct MI300X" and r1["host"] == "node-a"
    assert r1["util"] == 41.0 and r1["util_of"] == "gpu"
    assert r1["mem_used"] == 8 * 2**30 and r1["mem_total"] == 192 * 2**30
    assert r1["step"] == 29 and r1["loss"] == pytest.approx(2.0 / 31)
    assert [s["rank"] for s in body["loss"]] == [0, 1]
    assert body["loss"][0]["steps"] == list(range(30))
    assert body["loss"][0]["values"][0] == pytest.approx(2.0)


async def test_the_proxy_serves_the_monarch_page(jp_fetch, runtime, scheduler):
    cluster_id = scheduler_entry(scheduler)
    response = await jp_fetch("monarch", "proxy", cluster_id, "monarch")
    page = response.body.decode()
    assert response.code == 200 and response.headers["Content-Type"].startswith("text/html")
    assert "bokeh" in page and "monarch/figures.json" in page
    response = await jp_fetch(
        "monarch", "proxy", cluster_id, "monarch/figures.json", params={"points": "5"}
    )
    columns = json.loads(response.body)
    assert columns["bars"]["util"] == [40.0, 41.0]
    assert columns["bars"]["label"][0] == "rank 0 · AMD Instinct MI300X · node-a"
    assert [len(xs) for xs in columns["loss"]["xs"]] == [5, 5]
    assert columns["loss"]["xs"][0][-1] == 29  # thinned, the newest kept


async def test_delete_closes_the_scheduler_and_forgets_it(jp_fetch, runtime, scheduler):
    cluster_id = scheduler_entry(scheduler)
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE", headers=NO_TOKEN
    )
    assert code == 403 and scheduler.status.name == "running"
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
    )
    assert code == 200 and body["closed"] is True, body
    assert scheduler.status.name in ("closing", "closed")
    assert registry.get_entry(cluster_id) is None
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert body == {"clusters": [], "unreachable": []}


async def test_delete_leaves_a_joined_cluster_running(jp_fetch, runtime, scheduler):
    """A notebook that joined a cluster (%monarch connect) does not own its scheduler: the
    sidebar refuses to shut it down, and forgetting the entry leaves it running."""
    cluster_id = scheduler_entry(scheduler, owns_cluster=False)
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert body["clusters"][0]["owns_cluster"] is False
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
    )
    assert code == 409 and "joined with %monarch connect" in body["message"], body
    assert "shut it down where it was started (%monarch down in" in body["message"]
    assert scheduler.status.name == "running"
    assert registry.get_entry(cluster_id) is not None
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE", params={"forget": "1"}
    )
    assert code == 200 and body["closed"] is False and "forgot" in body["message"]
    assert registry.get_entry(cluster_id) is None
    assert scheduler.status.name == "running"


async def test_delete_leaves_a_scheduler_whose_entry_does_not_say_it_owns_it(
    jp_fetch, runtime, scheduler
):
    """An entry without ``owns_cluster`` (or with a non-boolean one) never shuts its scheduler
    down: the first is read as joined, the second is not trusted at all."""
    cluster_id = scheduler_entry(scheduler)
    path = runtime / "monarch-clusters" / f"{cluster_id}.json"
    entry = json.loads(path.read_text())
    del entry["owns_cluster"]
    path.write_text(json.dumps(entry))
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
    )
    assert code == 409 and "%monarch connect" in body["message"], body
    assert scheduler.status.name == "running"
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert body["clusters"][0]["owns_cluster"] is False  # the sidebar's button is disabled
    path.write_text(json.dumps({**entry, "owns_cluster": 1}))
    code, body = await status_of(
        jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
    )
    assert code == 404 and "owns_cluster is not true or false" in body["message"], body
    assert scheduler.status.name == "running"
    assert path.exists()


# -- the scheduler's routes and the shared view -----------------------------------------------
async def test_scheduler_json_routes_check_their_arguments(jp_asyncio_loop, scheduler):
    from tornado.httpclient import AsyncHTTPClient

    base = f"http://127.0.0.1:{scheduler.http_server.port}"
    client = AsyncHTTPClient()
    response = await client.fetch(f"{base}/monarch/metrics.json?samples=0&points=3")
    data = json.loads(response.body)
    ranks = data["metrics"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["samples"] == [] and len(r["scalars"]) == 3 for r in ranks)
    assert data["workers"] == []
    for bad in ("points=-1", "since=nan", "samples=x"):
        response = await client.fetch(f"{base}/monarch/metrics.json?{bad}", raise_error=False)
        assert response.code == 400, bad
    # installing twice adds the routes once
    assert dashboard.add_routes(scheduler) is False


def test_the_routes_configuration_serves_the_page_without_the_plugin(jp_asyncio_loop):
    """A scheduler started by hand with monarch_nb.telemetry.dashboard in its HTTP routes."""
    import dask
    from distributed import Scheduler
    from tornado.httpclient import AsyncHTTPClient

    routes = [
        *dask.config.get("distributed.scheduler.http.routes"),
        "monarch_nb.telemetry.dashboard",
    ]

    async def check():
        with dask.config.set({"distributed.scheduler.http.routes": routes}):
            s = await Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0")
        try:
            base = f"http://127.0.0.1:{s.http_server.port}"
            response = await AsyncHTTPClient().fetch(f"{base}/monarch/metrics.json")
            data = json.loads(response.body)
            assert data["workers"] == [] and data["metrics"]["ranks"] == []
            response = await AsyncHTTPClient().fetch(f"{base}/monarch")
            assert b"monarch/figures.json" in response.body
        finally:
            await s.close()

    jp_asyncio_loop.run_until_complete(check())


def test_rank_view_uses_cpu_when_there_is_no_gpu_and_keeps_workers_without_metrics():
    payload = {
        "time": 1.0,
        "workers": [
            {
                "name": 0,
                "host": "h0",
                "status": "running",
                "cpu": 5.0,
                "memory": 10,
                "memory_limit": 100,
            },
            {
                "name": 1,
                "host": "h1",
                "status": "paused",
                "cpu": 7.0,
                "memory": 20,
                "memory_limit": 100,
            },
        ],
        "metrics": {
            "ranks": [
                {
                    "rank": 0,
                    "worker": "0",
                    "host": "h0",
                    "step": 3,
                    "values": {"loss": None},
                    "sample": {
                        "device": "x86_64",
                        "kind": "cpu",
                        "util": None,
                        "cpu": 250.0,
                        "mem_used": 30,
                        "mem_total": 1000,
                    },
                    "scalars": [
                        [0, 0.0, {"loss": 1.0}],
                        [1, 0.1, {"acc": 0.5}],
                        [3, 0.2, {"loss": None}],
                    ],
                }
            ]
        },
    }
    view = figures.rank_view(payload)
    r0, r1 = view["ranks"]
    assert (r0["util"], r0["util_of"], r0["mem_used"], r0["mem_total"]) == (250.0, "cpu", 30, 1000)
    assert (r1["util"], r1["status"], r1["mem_used"], r1["device"]) == (7.0, "paused", 20, None)
    assert view["loss"] == [{"rank": 0, "steps": [0], "values": [1.0]}]
    bars = figures.bar_columns(view)
    assert bars["util"] == [100.0, 7.0]  # clipped to the bar; the text says the truth
    assert bars["util_text"] == ["CPU 250%", "CPU 7%"]
    assert bars["mem"] == [3.0, 20.0]


def test_non_finite_values_become_null():
    assert dashboard.finite({"a": [float("nan"), 1.0, float("inf")], "b": (2, float("-inf"))}) == {
        "a": [None, 1.0, None],
        "b": [2, None],
    }
