"""The Jupyter server extension trusts nothing it reads (issue 21): a registry entry or
directory someone tampered with is ignored and named once in the server log, the proxy forwards
none of Jupyter's credentials, and what a dashboard answers is bounded. A real ``jupyter
server`` (pytest-jupyter), real Dask schedulers, and small web servers standing in for
dashboards that record every request they get."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import stat
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import tornado.httpclient
import tornado.web
from _peers import CLAIMS_4_GIB
from _server_helpers import register, serve, status_of
from distributed import Security

from monarch_nb import registry
from monarch_nb.server import handlers as server

pytest_plugins = ["pytest_jupyter.jupyter_server"]


# -- the server extension trusts nothing read from disk ---------------------------------------


@pytest.fixture
def dashboard(jp_asyncio_loop):
    """A web server standing in for a dashboard, or for a service someone wants reached:
    ``seen`` records every request it got, ``answers[name]`` replaces the page whose path
    ends in that name."""
    seen: list[SimpleNamespace] = []
    answers: dict = {}

    class Page(tornado.web.RequestHandler):
        async def get(self, path):
            request = self.request
            seen.append(SimpleNamespace(uri=request.uri, headers=dict(request.headers)))
            answer = answers.get(path.rsplit("/", 1)[-1])
            if answer is not None:
                await answer(self)
            else:
                self.write(f"page {path}")

    url, http = serve(tornado.web.Application([(r"/(.*)", Page)]))
    yield SimpleNamespace(url=url, seen=seen, answers=answers)
    http.stop()


@pytest.fixture
def server_log(jp_serverapp):
    """The lines the Jupyter server logs."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    jp_serverapp.log.addHandler(handler)
    yield lines
    jp_serverapp.log.removeHandler(handler)


def _rewrite(path: Path, **change) -> None:
    """Change fields of an entry in place, keeping the file owner-only; None drops a field."""
    entry = json.loads(path.read_text())
    entry.update(change)
    path.write_text(json.dumps({k: v for k, v in entry.items() if v is not None}))


def _symlink(path: Path, tmp_path: Path) -> None:
    """The entry becomes a symlink to a valid-looking, owner-only file elsewhere."""
    target = tmp_path / "elsewhere.json"
    path.rename(target)
    path.symlink_to(target)


def _replace(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


_OTHERS: list[subprocess.Popen] = []  # killed after the test


def _other_users_process(path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    _OTHERS.append(proc)
    _rewrite(path, pid=proc.pid, pid_started=psutil.Process(proc.pid).create_time())


# (id, what is done to a valid entry at ``path`` whose dashboard is ``url``, the reason given)
TAMPERED = [
    ("other-owner", lambda p, url, tmp: os.chown(p, 65534, 65534), "owned by uid 65534"),
    ("mode-666", lambda p, url, tmp: p.chmod(0o666), "mode is 666"),
    ("mode-640", lambda p, url, tmp: p.chmod(0o640), "mode is 640"),
    ("symlink", lambda p, url, tmp: _symlink(p, tmp), "is a symlink"),
    ("fifo", lambda p, url, tmp: (p.unlink(), os.mkfifo(p, 0o600)), "not a regular file"),
    ("directory", lambda p, url, tmp: (p.unlink(), p.mkdir(0o700)), "not a regular file"),
    ("pid-1-no-start", lambda p, url, tmp: _rewrite(p, pid=1, pid_started=None), "pid 1"),
    ("pid-true", lambda p, url, tmp: _rewrite(p, pid=True, pid_started=None), "pid is not"),
    ("pid-of-other-user", lambda p, url, tmp: _other_users_process(p), "belongs to uid 65534"),
    (
        "dashboard-elsewhere",
        lambda p, url, tmp: _rewrite(p, scheduler_address="tcp://10.0.0.1:8786"),
        "not on the scheduler's host",
    ),
    (
        "dashboard-path",
        lambda p, url, tmp: _rewrite(p, dashboard_url=url + "api/contents/"),
        "dashboard_url is not",
    ),
    (
        "dashboard-userinfo",
        lambda p, url, tmp: _rewrite(p, dashboard_url=url.replace("//", "//u:p@")),
        "dashboard_url is not",
    ),
    (
        "dashboard-port-out-of-range",
        lambda p, url, tmp: _rewrite(p, dashboard_url="http://127.0.0.1:99999/"),
        "dashboard_url is not",
    ),
    (
        "dashboard-file",
        lambda p, url, tmp: _rewrite(p, dashboard_url="file:///etc/passwd"),
        "dashboard_url is not",
    ),
    (
        "scheduler-inproc",
        lambda p, url, tmp: _rewrite(p, scheduler_address="inproc://127.0.0.1/1/1"),
        "scheduler_address is not",
    ),
    ("owns-cluster-string", lambda p, url, tmp: _rewrite(p, owns_cluster="yes"), "owns_cluster"),
    ("kernel-id-list", lambda p, url, tmp: _rewrite(p, kernel_id=[1]), "kernel_id is not"),
    ("started-string", lambda p, url, tmp: _rewrite(p, started="today"), "started is not"),
    ("ranks-negative", lambda p, url, tmp: _rewrite(p, ranks=-1), "ranks is not"),
    ("id-mismatch", lambda p, url, tmp: _rewrite(p, id="0" * 32), "its id is not"),
    ("oversized", lambda p, url, tmp: _rewrite(p, pad="x" * 2**20), "larger than 65536"),
    ("deep-json", lambda p, url, tmp: _replace(p, b"[" * 60_000), "not valid JSON"),
    ("not-utf8", lambda p, url, tmp: _replace(p, b"\xff\xfe{}"), "not valid JSON"),
    ("json-list", lambda p, url, tmp: _replace(p, b"[]"), "not a JSON object"),
    ("nan-start", lambda p, url, tmp: _rewrite(p, pid_started=float("nan")), "no start time"),
    (
        "unix-socket",
        lambda p, url, tmp: (p.unlink(), os.mknod(p, stat.S_IFSOCK | 0o600)),
        "unreadable",
    ),
    (
        "char-device",  # /dev/zero's numbers: endless zeros, were it read
        lambda p, url, tmp: (p.unlink(), os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))),
        "not a regular file",
    ),
]
# chown, a process of another user and mknod of a device need root
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
NEEDS_ROOT = {"other-owner", "pid-of-other-user", "char-device"}


@pytest.mark.parametrize(
    "tamper, reason",
    [
        pytest.param(*c[1:], id=c[0], marks=[ROOT_ONLY] if c[0] in NEEDS_ROOT else [])
        for c in TAMPERED
    ],
)
async def test_a_tampered_registry_entry_is_ignored_and_named_once_in_the_log(
    jp_fetch, runtime, dashboard, server_log, tmp_path, tamper, reason
):
    cluster_id = register(dashboard.url + "status")
    path = runtime / "monarch-clusters" / f"{cluster_id}.json"
    try:
        tamper(path, dashboard.url, tmp_path)
        code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
        assert (code, body) == (200, {"clusters": [], "unreachable": []})
        api = ("monarch", "api", "clusters", cluster_id)
        for parts, method in (
            (api, "GET"),
            ((*api, "metrics"), "GET"),
            (("monarch", "proxy", cluster_id, "page"), "GET"),
            (api, "DELETE"),
        ):
            code, body = await status_of(jp_fetch, *parts, method=method)
            assert code == 404, (parts, method, body)
        assert reason in body["message"] and "see the server log" in body["message"]
        assert dashboard.seen == []  # never followed
        assert os.path.lexists(path)  # nor deleted: it is not ours to trust
        named = [line for line in server_log if "monarch_nb: ignoring" in line]
        assert len(named) == 1 and reason in named[0], server_log
        # any Python reader, too
        assert registry.get_entry(cluster_id) is None
        assert registry.list_entries() == []
    finally:
        for proc in _OTHERS:
            proc.kill()
            proc.wait()
        _OTHERS.clear()


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda d, tmp: d.chmod(0o777), "writable by others"),
        pytest.param(
            lambda d, tmp: os.chown(d, 65534, 65534), "owned by uid 65534", marks=ROOT_ONLY
        ),
        (lambda d, tmp: (d.rename(tmp / "moved"), d.symlink_to(tmp / "moved")), "cannot open"),
    ],
    ids=["writable-by-others", "other-owner", "symlink"],
)
async def test_a_tampered_registry_directory_is_ignored(
    jp_fetch, runtime, dashboard, server_log, tmp_path, tamper, reason
):
    cluster_id = register(dashboard.url + "status")
    tamper(runtime / "monarch-clusters", tmp_path)
    for _ in range(2):
        code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
        assert (code, body) == (200, {"clusters": [], "unreachable": []})
    code, body = await status_of(jp_fetch, "monarch", "proxy", cluster_id, "page")
    assert code == 404
    assert dashboard.seen == []
    named = [line for line in server_log if "monarch_nb: ignoring" in line]
    assert len(named) == 1 and reason in named[0], server_log


async def test_the_proxy_forwards_none_of_jupyters_credentials(
    jp_fetch, jp_serverapp, http_server_client, runtime, dashboard
):
    token = jp_serverapp.identity_provider.token
    cluster_id = register(dashboard.url + "status")
    browser = {
        "Cookie": "_xsrf=2|abc|def; username-127-0-0-1-8888=login-secret",
        "X-XSRFToken": "2|abc|def",
        "Referer": f"http://127.0.0.1:8888/lab?token={token}",
        "Origin": "http://127.0.0.1:8888",
        "Accept": "text/html",
        "If-None-Match": '"v1"',
    }
    params = {"x": "1", "token": token, "_xsrf": "2|abc|def", "y": "a b"}
    response = await jp_fetch(
        "monarch", "proxy", cluster_id, "page", params=params, headers=browser
    )
    assert response.code == 200 and response.body == b"page page"
    # the token in any spelling Jupyter accepts, and the header it is usually sent in
    await http_server_client.fetch(
        f"/a%40b/monarch/proxy/{cluster_id}/page?to%6Ben={token}&x=2",
        headers={"Authorization": f"token {token}"},
    )
    first, second = dashboard.seen
    assert first.uri == "/page?x=1&y=a+b" and second.uri == "/page?x=2"
    for seen in (first, second):
        sent = " ".join([seen.uri, *seen.headers.values()])
        assert token not in sent and "secret" not in sent and "abc" not in sent, seen
        names = {name.lower() for name in seen.headers}
        assert not names & {"authorization", "cookie", "x-xsrftoken", "referer", "origin"}
    assert first.headers["Accept"] == "text/html" and first.headers["If-None-Match"] == '"v1"'


# -- ... nor what a dashboard answers ----------------------------------------------------------
def _redirect(location: str):
    async def answer(handler):
        handler.redirect(location.format(url=handler.request.full_url().rsplit("/", 1)[0]))

    return answer


async def _big(handler):
    handler.write(b"x" * (server.MAX_BODY + 1))


async def _big_chunked(handler):
    for _ in range(server.MAX_BODY // 2**20 + 2):
        handler.write(b"y" * 2**20)
        await handler.flush()


async def _gzip_bomb(handler):
    handler.set_header("Content-Encoding", "gzip")
    handler.write(gzip.compress(bytes(server.MAX_BODY + 2**20)))  # ~17 KiB on the wire


async def _not_modified(handler):
    handler.set_status(304)


async def _cookie_and_headers(handler):
    handler.set_cookie("dashboard", "1")
    handler.set_header("Access-Control-Allow-Origin", "*")
    handler.set_header("Content-Security-Policy", "default-src *")
    handler.set_header("Content-Type", "text/plain")
    handler.write("plain")


async def _silent(handler):
    await asyncio.sleep(4)


# (id, path, its answer, status through the proxy, what the proxy's answer contains)
ANSWERS = [
    ("redirect-other-host", "r", _redirect("http://127.0.0.2:9/x"), 502, b"outside its own"),
    ("redirect-protocol-relative", "r", _redirect("//evil.example/x"), 502, b"outside"),
    ("redirect-backslash", "r", _redirect("/\\evil.example/x"), 502, b"outside"),
    ("redirect-dotdot", "r", _redirect("/../../api/contents"), 302, "{base}/api/contents"),
    ("redirect-encoded-dotdot", "r", _redirect("/%2e%2e/%2e%2e/api/contents"), 502, b"outside"),
    ("redirect-javascript", "r", _redirect("javascript:alert(1)"), 502, b"outside"),
    ("redirect-markup", "r", _redirect("/<script>alert(1)</script>"), 502, b"/&lt;script&gt;alert"),
    ("redirect-absolute-same", "r", _redirect("{url}/status?x=1"), 302, "{base}/status?x=1"),
    ("redirect-relative", "d/r", _redirect("sub/page"), 302, "{base}/d/sub/page"),
    ("body-over-limit", "big", _big, 502, b"over 16777216 bytes"),
    ("chunked-over-limit", "big", _big_chunked, 502, b"over 16777216 bytes"),
    ("gzip-bomb", "gz", _gzip_bomb, 502, b"over 16777216 bytes"),
    ("not-modified", "nm", _not_modified, 304, b""),
    ("cookie-and-cors", "c", _cookie_and_headers, 200, b"plain"),
    ("no-answer", "slow", _silent, 410, b"does not answer"),
]


@pytest.mark.parametrize(
    "path, answer, status, expected", [c[1:] for c in ANSWERS], ids=[c[0] for c in ANSWERS]
)
async def test_what_the_dashboard_answers_is_bounded(
    jp_fetch, runtime, dashboard, monkeypatch, path, answer, status, expected
):
    monkeypatch.setattr(server, "REQUEST_TIMEOUT", 1.0)
    dashboard.answers[path.rsplit("/", 1)[-1]] = answer
    cluster_id = register(dashboard.url + "status")
    start = time.monotonic()
    try:
        response = await jp_fetch("monarch", "proxy", cluster_id, path, follow_redirects=False)
    except tornado.httpclient.HTTPClientError as e:
        response = e.response
    assert response.code == status, response.body[:300]
    assert time.monotonic() - start < 10
    # none of the dashboard's own headers but the few a page needs
    assert "dashboard=" not in response.headers.get("Set-Cookie", "")
    assert response.headers.get("Access-Control-Allow-Origin") != "*", dict(response.headers)
    assert response.headers.get("Content-Security-Policy") != "default-src *"
    if isinstance(expected, str):  # a redirect kept below the proxy
        base = f"/a%40b/monarch/proxy/{cluster_id}"
        assert response.headers["Location"] == expected.format(base=base)
    else:
        assert "Location" not in response.headers
        assert expected in (response.body or b"")
    # the server goes on serving
    ok = await jp_fetch("monarch", "proxy", cluster_id, "page")
    assert ok.body == b"page page"


@pytest.mark.parametrize(
    "body", [b"[]", b'{"workers": 5}', b'{"metrics": {"ranks": [1]}}', b"[" * 60_000, b"\xff"]
)
async def test_malformed_metrics_are_one_line(jp_fetch, runtime, dashboard, body):
    async def answer(handler):
        handler.write(body)

    dashboard.answers["metrics.json"] = answer
    cluster_id = register(dashboard.url + "status")
    code, reply = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
    assert code == 502 and reply["message"] == (
        f"the dashboard of cluster {cluster_id} sent malformed metrics"
    )


# -- the sidebar's "Shut down" --------------------------------------------------------------------
async def _garbage(reader, writer):
    writer.write(b"\xff" * 64 + b"SSH-2.0-OpenSSH_9.6\r\n")
    await writer.drain()
    writer.close()


async def _claims_4_gib(reader, writer):
    writer.write(CLAIMS_4_GIB)  # which Dask allocated, then waited for
    await writer.drain()
    await reader.read()


async def _silent_peer(reader, writer):
    await reader.read()  # until the client gives up


@pytest.mark.parametrize(
    "peer, says",
    [
        (
            _garbage,
            "{address} answered, but not as a Dask scheduler (its first bytes (ff ff ff ff ff ff "
            "ff ff) claim a message of 16 EiB; a handshake is 64 KiB at most)",
        ),
        (
            _claims_4_gib,
            "{address} answered, but not as a Dask scheduler (its first bytes (00 00 00 00 01 00 "
            "00 00) claim a message of 4 GiB; a handshake is 64 KiB at most)",
        ),
        (_silent_peer, "the scheduler at {address} did not answer (TimeoutError)"),
    ],
    ids=["garbage", "claims-4-gib", "silent"],
)
async def test_delete_at_an_address_that_is_no_scheduler(jp_fetch, runtime, peer, says):
    listener = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    cluster_id = register(None, f"tcp://127.0.0.1:{port}")
    start = time.monotonic()
    try:
        code, body = await status_of(
            jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
        )
    finally:
        listener.close()
    assert code == 200 and body["closed"] is False, body
    assert body["message"].startswith(says.format(address=f"tcp://127.0.0.1:{port}")), body
    assert body["message"].endswith("; forgot it anyway")
    assert time.monotonic() - start < server.CONNECT_TIMEOUT + server.CLOSE_TIMEOUT + 3


async def test_delete_of_a_tls_cluster_says_where_to_shut_it_down(jp_fetch, runtime):
    from distributed import Scheduler

    s = await Scheduler(
        host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0", security=Security.temporary()
    )
    try:
        cluster_id = register(f"http://127.0.0.1:{s.http_server.port}/status", s.address)
        code, body = await status_of(
            jp_fetch, "monarch", "api", "clusters", cluster_id, method="DELETE"
        )
        assert code == 409, body
        assert body["message"] == (
            f"cluster {cluster_id} at {s.address} speaks TLS and this Jupyter server holds "
            "none of its certificates (distributed.comm.tls in Dask's config); shut it down "
            "with %monarch down in its notebook"
        )
        assert s.status.name == "running"
        assert registry.get_entry(cluster_id) is not None
    finally:
        await s.close()


@pytest.mark.parametrize(
    "query, forwarded",
    [
        ("x=%zz&token", "/page?x=%zz"),
        ("%74oken={token}&_%78srf=1&x=1", "/page?x=1"),
        ("=&&x=1&&", "/page?=&x=1"),
        ("next=token%3Dabc", "/page?next=token%3Dabc"),
        ("x=\xff", "/page?x=%C3%BF"),  # the test client sends it as UTF-8
    ],
    ids=["bad-escape", "escaped-names", "empty-parts", "token-in-a-value", "raw-non-ascii"],
)
async def test_odd_queries_reach_the_dashboard_without_credentials(
    jp_serverapp, http_server_client, runtime, dashboard, query, forwarded
):
    token = jp_serverapp.identity_provider.token
    cluster_id = register(dashboard.url + "status")
    response = await http_server_client.fetch(
        f"/a%40b/monarch/proxy/{cluster_id}/page?{query.format(token=token)}",
        headers={"Authorization": f"token {token}"},
    )
    assert response.code == 200
    assert [seen.uri for seen in dashboard.seen] == [forwarded]


async def _no_metrics(handler):
    handler.write({"workers": [], "metrics": {"ranks": []}})


async def test_hung_dashboards_do_not_hold_up_the_server(
    jp_serverapp, http_server_client, runtime, dashboard, monkeypatch
):
    monkeypatch.setattr(server, "REQUEST_TIMEOUT", 2.0)
    dashboard.answers["slow"] = _silent
    dashboard.answers["metrics.json"] = _no_metrics
    cluster_id = register(dashboard.url + "status")
    base = http_server_client.get_url("/a%40b/monarch")
    auth = {"Authorization": f"token {jp_serverapp.identity_provider.token}"}
    # a client of its own, not the test's, which sends 10 requests at a time
    client = tornado.httpclient.AsyncHTTPClient(force_instance=True, max_clients=50)
    try:
        hung = [
            client.fetch(f"{base}/proxy/{cluster_id}/slow", headers=auth, raise_error=False)
            for _ in range(20)
        ]
        while len(dashboard.seen) < 20:  # every request is waiting on the dashboard
            await asyncio.sleep(0.05)
        start = time.monotonic()
        response = await client.fetch(f"{base}/api/clusters", headers=auth)
        assert [row["id"] for row in json.loads(response.body)["clusters"]] == [cluster_id]
        # nor the requests to other dashboards (a shared client would queue them behind)
        response = await client.fetch(f"{base}/api/clusters/{cluster_id}/metrics", headers=auth)
        assert json.loads(response.body)["state"] == "up"
        assert time.monotonic() - start < 1.5
        assert [r.code for r in await asyncio.gather(*hung)] == [410] * 20
    finally:
        client.close()
