"""Jupyter server extension: what the Monarch sidebar asks for, over authenticated REST.

    GET    /monarch/api/clusters               the registered clusters (see registry.py)
    GET    /monarch/api/clusters/<id>/metrics  one cluster's ranks and losses, read from its
                                               scheduler's /monarch/metrics.json
    DELETE /monarch/api/clusters/<id>          shut that cluster's scheduler (and so its workers)
                                               down, if its notebook started it; ?forget=1
                                               only drops the entry
                                               down and forget it
    GET    /monarch/proxy/<id>/<path>          a page of that cluster's dashboard, e.g. monarch

The proxy only ever reaches the dashboard URL of a registered, live entry; the request chooses
the entry and a path below it, never a host. A scheduler that does not answer within a few
seconds is reported as gone (410), so the sidebar never spins forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse

from . import registry

CONNECT_TIMEOUT = 2.0  # seconds; the schedulers are on this machine or this allocation
REQUEST_TIMEOUT = 8.0
CLOSE_TIMEOUT = 5.0
_SAFE_PATH = re.compile(r"[A-Za-z0-9_.~/-]*")
_PASSED_HEADERS = ("Content-Type", "Cache-Control", "Last-Modified", "ETag")


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "monarch_nb.server"}]


def _load_jupyter_server_extension(serverapp) -> None:
    base = serverapp.web_app.settings["base_url"]
    cluster = r"/monarch/api/clusters/([^/]+)"
    handlers = [
        (r"/monarch/api/clusters/?", ClustersHandler),
        (cluster + r"/metrics/?", MetricsHandler),
        (cluster + r"/?", ClusterHandler),
        (r"/monarch/proxy/([^/]+)/?(.*)", ProxyHandler),
    ]
    serverapp.web_app.add_handlers(
        ".*$", [(url_path_join(base, pattern), handler) for pattern, handler in handlers]
    )
    serverapp.log.info("monarch_nb: sidebar API at %smonarch/api/clusters", base)


class Gone(Exception):
    """The cluster's scheduler (or its dashboard) did not answer."""


def live_entry(cluster_id: str) -> dict[str, Any]:
    """The registered entry for ``cluster_id``, or the HTTP error the request deserves."""
    if not registry.valid_id(cluster_id):
        raise tornado.web.HTTPError(400, "malformed cluster id: expected 32 hex digits")
    entry = registry.get_entry(cluster_id)
    if entry is None:
        # the id is validated: no "%" in these messages, which APIHandler shows unformatted
        raise tornado.web.HTTPError(404, f"no cluster with id {cluster_id} is registered")
    return entry


async def fetch_dashboard(entry: dict[str, Any], path: str, query: str = "", **kw) -> HTTPResponse:
    """GET ``path`` below the entry's dashboard URL; raises Gone if nothing answers."""
    base = entry.get("dashboard_url")
    if not base:
        raise tornado.web.HTTPError(
            502, f"cluster {entry['id']} has no dashboard (its scheduler runs without one)"
        )
    url = base + path + (f"?{query}" if query else "")
    request = HTTPRequest(
        url,
        method="GET",
        connect_timeout=CONNECT_TIMEOUT,
        request_timeout=REQUEST_TIMEOUT,
        follow_redirects=False,
        **kw,
    )
    try:
        return await AsyncHTTPClient().fetch(request, raise_error=False)
    except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
        raise Gone(f"the scheduler's dashboard at {base} does not answer: {e}") from None


class NoBody:
    """Every route here takes no request body; one is refused (413) before anything happens,
    so an oversized or stray body never reaches a handler (a DELETE with a body included)."""

    async def prepare(self):
        await super().prepare()
        if self.request.body:
            raise tornado.web.HTTPError(413, "the monarch API takes no request body")


def _cluster_row(entry: dict[str, Any], notebooks: dict[str, str]) -> dict[str, Any]:
    row = dict(entry)
    row.pop("pid_started", None)
    row["notebook"] = notebooks.get(entry.get("kernel_id") or "")
    return row


class ClustersHandler(NoBody, APIHandler):
    @tornado.web.authenticated
    async def get(self):
        notebooks: dict[str, str] = {}
        with contextlib.suppress(Exception):  # the session list is a nicety, never a failure
            for session in await self.session_manager.list_sessions():
                kernel = session.get("kernel") or {}
                notebooks[kernel.get("id", "")] = session.get("path")
        rows = [_cluster_row(e, notebooks) for e in registry.list_entries(prune=True)]
        self.finish(json.dumps({"clusters": rows}))


class MetricsHandler(NoBody, APIHandler):
    @tornado.web.authenticated
    async def get(self, cluster_id: str):
        from .figures import rank_view

        entry = live_entry(cluster_id)
        try:
            response = await fetch_dashboard(entry, "monarch/metrics.json", "points=500&samples=1")
        except Gone as e:
            self.set_status(410)
            self.finish(json.dumps({"id": cluster_id, "state": "gone", "message": str(e)}))
            return
        if response.code == 404:
            raise tornado.web.HTTPError(
                502,
                f"the dashboard of cluster {cluster_id} has no /monarch/metrics.json; is "
                "monarch_nb installed where its scheduler runs?",
            )
        if response.code != 200:
            raise tornado.web.HTTPError(
                502, f"the dashboard of cluster {cluster_id} answered {response.code}"
            )
        try:
            data = json.loads(response.body)
        except ValueError:
            raise tornado.web.HTTPError(
                502, f"the dashboard of cluster {cluster_id} sent malformed JSON"
            ) from None
        self.finish(json.dumps({"id": cluster_id, "state": "up", **rank_view(data)}))


class ClusterHandler(NoBody, APIHandler):
    @tornado.web.authenticated
    async def get(self, cluster_id: str):
        entry = live_entry(cluster_id)
        self.finish(json.dumps(_cluster_row(entry, {})))

    @tornado.web.authenticated
    async def delete(self, cluster_id: str):
        """Shut a cluster that a notebook started down; ``?forget=1`` only drops the entry (a
        cluster whose scheduler is gone). A cluster that a notebook joined is refused: other
        notebooks or jobs may be using its scheduler."""
        entry = live_entry(cluster_id)
        address = entry["scheduler_address"]
        if self.get_query_argument("forget", "") == "1":
            registry.unregister(cluster_id)
            message = f"forgot the cluster at {address}"
            self.finish(json.dumps({"id": cluster_id, "closed": False, "message": message}))
            return
        if entry.get("owns_cluster", True) is False:
            raise tornado.web.HTTPError(
                409,
                f"cluster {cluster_id} at {address} was joined with %monarch connect, not "
                "started by its notebook; shut it down where it was started (%monarch down "
                "in the notebook only leaves it)",
            )
        closed, message = await close_scheduler(address)
        registry.unregister(cluster_id)
        self.finish(json.dumps({"id": cluster_id, "closed": closed, "message": message}))


async def close_scheduler(address: str) -> tuple[bool, str]:
    """Ask the scheduler at ``address`` to close (its workers go with it); never waits long."""
    from distributed.comm.core import CommClosedError
    from distributed.core import rpc

    remote = rpc(address, timeout=CONNECT_TIMEOUT)
    try:
        await asyncio.wait_for(remote.terminate(), CLOSE_TIMEOUT)
    except (CommClosedError, EOFError):
        pass  # the scheduler closed the connection as it went down: the outcome we asked for
    except (OSError, asyncio.TimeoutError) as e:
        return False, f"the scheduler at {address} did not answer ({e}); forgot it anyway"
    finally:
        with contextlib.suppress(Exception):
            await remote.close_rpc()
    return True, f"closed the scheduler at {address}"


class ProxyHandler(NoBody, JupyterHandler):
    """A dashboard page of a registered cluster. An HTML page (not an APIHandler) so that its
    scripts may run inside JupyterLab's frame; a request without credentials still gets 403."""

    def get_login_url(self) -> str:
        if not self.current_user:
            raise tornado.web.HTTPError(403, "authentication required")
        return super().get_login_url()

    @tornado.web.authenticated
    async def get(self, cluster_id: str, path: str):
        if not _SAFE_PATH.fullmatch(path) or path.startswith("/") or "//" in path:
            raise tornado.web.HTTPError(400, "refusing dashboard path %r", path)
        if any(part in (".", "..") for part in path.split("/")):
            raise tornado.web.HTTPError(400, "refusing dashboard path %r", path)
        entry = live_entry(cluster_id)
        try:
            response = await fetch_dashboard(entry, path, self.request.query)
        except Gone as e:
            raise tornado.web.HTTPError(410, "%s", e) from None
        self.set_status(response.code)
        for name in _PASSED_HEADERS:
            if name in response.headers:
                self.set_header(name, response.headers[name])
        location = response.headers.get("Location")
        if location and location.startswith("/") and not location.startswith("//"):
            # an absolute path on the dashboard stays below this cluster's proxy
            base = url_path_join(self.base_url, "monarch/proxy", cluster_id)
            self.set_header("Location", base + location)
        self.finish(response.body or b"")
