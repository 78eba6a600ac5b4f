"""Jupyter server extension: what the Monarch sidebar asks for, over authenticated REST.

    GET    /monarch/api/clusters               the registered clusters whose dashboard answers
                                               this server, and why not the others (see
                                               registry.py, reachable.py)
    GET    /monarch/api/clusters/<id>/metrics  one cluster's ranks and losses, read from its
                                               scheduler's /monarch/metrics.json
    DELETE /monarch/api/clusters/<id>          shut that cluster's scheduler (and so its workers)
                                               down, if its notebook started it; ?forget=1
                                               only drops the entry
    GET    /monarch/proxy/<id>/<path>          a page of that cluster's dashboard, e.g. monarch
    GET    /monarch/api/kept                   kept clusters (kept_routes.py); DELETE .../<id>

The proxy only ever reaches the dashboard URL of a registered, live entry that passed
registry.py's checks (owner, mode, no symlink, a live controller, and a dashboard on the
scheduler's own host); the request chooses the entry and a path below it, never a host. An
entry that fails is answered 404 and named once in the server log. The proxy forwards none of
Jupyter's credentials: no header but those of ``_FORWARDED_HEADERS`` (so no Authorization,
Cookie or X-XSRFToken) and the query without ``token`` and ``_xsrf``. What comes back is
bounded (``MAX_BODY`` bytes, a few headers, redirects only to the dashboard's own pages). A
scheduler that does not answer within a few seconds is reported as gone (410), so the sidebar
never spins forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any
from urllib.parse import unquote_plus, urljoin, urlsplit

import tornado.httputil
import tornado.web
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.simple_httpclient import HTTPStreamClosedError

from monarch_nb import registry
from monarch_nb.server import bokeh_static, kept_routes, reachable

CONNECT_TIMEOUT = 2.0  # seconds; the schedulers are on this machine or this allocation
REQUEST_TIMEOUT = 8.0
CLOSE_TIMEOUT = 5.0
_SAFE_PATH = re.compile(r"[A-Za-z0-9_.~/-]*")
_PASSED_HEADERS = ("Content-Type", "Cache-Control", "Last-Modified", "ETag")
# what a dashboard page needs from the browser's request; nothing that authenticates to Jupyter
_FORWARDED_HEADERS = ("Accept", "If-None-Match", "If-Modified-Since")
_CREDENTIAL_ARGS = frozenset({"token", "_xsrf"})  # the query arguments Jupyter authenticates by
MAX_BODY = 16 * 2**20  # bytes; the largest dashboard file (bokeh's JavaScript) is ~1 MiB


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
        *bokeh_static.handlers(),  # BokehJS for the page, offline
        *kept_routes.handlers(),  # kept clusters, the detached ones shut down from the sidebar
    ]
    serverapp.web_app.add_handlers(
        ".*$", [(url_path_join(base, pattern), handler) for pattern, handler in handlers]
    )
    serverapp.log.info("monarch_nb: sidebar API at %smonarch/api/clusters", base)


class Gone(Exception):
    """The cluster's scheduler (or its dashboard) did not answer."""


def live_entry(cluster_id: str, log) -> dict[str, Any]:
    """The registered, checked entry for ``cluster_id``, or the HTTP error the request
    deserves; an entry not to be trusted is reported to ``log`` and never used."""
    if not registry.valid_id(cluster_id):
        raise tornado.web.HTTPError(400, "malformed cluster id: expected 32 hex digits")
    try:
        entry = registry.load_entry(cluster_id)
    except registry.InvalidEntry as e:
        registry.report(e, log)
        raise tornado.web.HTTPError(
            404, f"cluster {cluster_id} is ignored: {e.reason} (see the server log)"
        ) from None
    if entry is None:
        raise tornado.web.HTTPError(404, f"no cluster with id {cluster_id} is registered")
    return entry


def safe_path(path: str) -> bool:
    """A path below the dashboard's root that stays there, however a browser or server
    normalises it (no dot segments, no percent-escapes, no backslash, no empty segment)."""
    return (
        bool(_SAFE_PATH.fullmatch(path))
        and not path.startswith("/")
        and "//" not in path
        and not any(part in (".", "..") for part in path.split("/"))
    )


def forwarded_query(query: str) -> str:
    """``query`` without Jupyter's credentials, in any spelling its server would accept
    (``to%6Ben=``), the rest byte for byte but for raw bytes outside ASCII, which are
    percent-escaped (tornado reads the request line as latin-1 and would send them as UTF-8)."""
    kept = (p for p in query.split("&") if p)
    query = "&".join(p for p in kept if unquote_plus(p.partition("=")[0]) not in _CREDENTIAL_ARGS)
    return "".join(c if " " < c < "\x7f" else f"%{ord(c):02X}" for c in query)


async def fetch_dashboard(
    entry: dict[str, Any],
    path: str,
    query: str = "",
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> HTTPResponse:
    """GET ``path`` below the entry's checked dashboard URL; raises Gone if nothing answers
    within ``timeout`` seconds (REQUEST_TIMEOUT), or a 502 for an answer over ``MAX_BODY``."""
    timeout = REQUEST_TIMEOUT if timeout is None else timeout
    base = entry["dashboard_url"]
    if not base:
        raise tornado.web.HTTPError(
            502, f"cluster {entry['id']} has no dashboard (its scheduler runs without one)"
        )
    url = base + path + (f"?{query}" if query else "")
    # a header_callback leaves the response's headers empty: they are parsed here instead, so
    # that an oversized answer can be told from a dashboard that went away
    received = tornado.httputil.HTTPHeaders()
    started = []

    def header_line(line: str) -> None:
        if line.startswith("HTTP/"):
            started.append(line)
        elif line.strip():
            received.parse_line(line)

    request = HTTPRequest(
        url,
        method="GET",
        headers=headers or {},
        connect_timeout=min(CONNECT_TIMEOUT, timeout),
        request_timeout=timeout,
        follow_redirects=False,
        header_callback=header_line,
    )
    # a client of its own: the shared one buffers up to 100 MB an answer, and queues every
    # cluster's requests behind its 10 slots, which a hung dashboard holds for REQUEST_TIMEOUT
    client = AsyncHTTPClient(force_instance=True, max_body_size=MAX_BODY)
    try:
        response = await client.fetch(request, raise_error=False)
    except HTTPStreamClosedError:
        if not started:
            raise Gone(f"the scheduler's dashboard at {base} closed the connection") from None
        # max_body_size closes the stream too, so the two cannot be told apart
        raise tornado.web.HTTPError(
            502, f"the dashboard's answer to /{path} is over {MAX_BODY} bytes or was cut short"
        ) from None
    except (OSError, HTTPClientError, asyncio.TimeoutError) as e:
        raise Gone(f"the scheduler's dashboard at {base} does not answer: {e}") from None
    finally:
        client.close()
    response.headers = received
    return response


class NoBody:
    """Every route here takes no request body; one is refused (413) before anything happens,
    so an oversized or stray body never reaches a handler (a DELETE with a body included)."""

    async def prepare(self):
        await super().prepare()
        if self.request.body:
            raise tornado.web.HTTPError(413, "the monarch API takes no request body")


class Api(NoBody, APIHandler):
    """An API route whose error messages read as written: APIHandler shows an HTTPError's
    format string unformatted, so a "%" (of "%monarch down") came out doubled."""

    def write_error(self, status_code: int, **kwargs) -> None:
        error = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(error, tornado.web.HTTPError) and error.log_message:
            self.set_header("Content-Type", "application/json")
            message = error.log_message % error.args
            self.finish(json.dumps({"message": message, "reason": error.reason}))
            return
        super().write_error(status_code, **kwargs)


def _cluster_row(entry: dict[str, Any], notebooks: dict[str, str]) -> dict[str, Any]:
    row = dict(entry)  # a checked entry: only the known fields, each of its type
    row.pop("pid_started", None)
    row["notebook"] = notebooks.get(entry["kernel_id"] or "")
    return row


class ClustersHandler(Api):
    @tornado.web.authenticated
    async def get(self):
        notebooks: dict[str, str] = {}
        with contextlib.suppress(Exception):  # the session list is a nicety, never a failure
            for session in await self.session_manager.list_sessions():
                kernel = session.get("kernel") or {}
                notebooks[kernel.get("id", "")] = session.get("path")
        entries = registry.list_entries(prune=True, logger=self.log)
        listed, left_out = await reachable.split(entries, _probe)
        rows = [_cluster_row(e, notebooks) for e in listed]
        unreachable = [{**_cluster_row(e, notebooks), "why": why} for e, why in left_out]
        self.finish(json.dumps({"clusters": rows, "unreachable": unreachable}))


async def _probe(entry: dict[str, Any], timeout: float) -> None:
    """Raises unless the entry's dashboard answers (any page will do) within ``timeout``."""
    await fetch_dashboard(entry, "monarch/metrics.json", "points=1&samples=1", timeout=timeout)


class MetricsHandler(Api):
    @tornado.web.authenticated
    async def get(self, cluster_id: str):
        from monarch_nb.telemetry.figures import rank_view

        entry = live_entry(cluster_id, self.log)
        why = reachable.process_reason(entry["pid"])  # stopped: no need to wait to know
        try:
            if why is not None:
                raise Gone(why)
            response = await fetch_dashboard(entry, "monarch/metrics.json", "points=500&samples=1")
        except Gone as e:
            self.set_status(410)
            self.finish(json.dumps({"id": cluster_id, "state": "gone", "message": str(e)}))
            return
        reachable.answered(cluster_id)
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
            view = rank_view(json.loads(response.body))
        except (ValueError, RecursionError, TypeError, AttributeError, KeyError, IndexError):
            raise tornado.web.HTTPError(
                502, f"the dashboard of cluster {cluster_id} sent malformed metrics"
            ) from None
        self.finish(json.dumps({"id": cluster_id, "state": "up", **view}))


class ClusterHandler(Api):
    @tornado.web.authenticated
    async def get(self, cluster_id: str):
        entry = live_entry(cluster_id, self.log)
        self.finish(json.dumps(_cluster_row(entry, {})))

    @tornado.web.authenticated
    async def delete(self, cluster_id: str):
        """Shut a cluster that a notebook started down; ``?forget=1`` only drops the entry (a
        cluster whose scheduler is gone). A cluster that a notebook joined is refused: other
        notebooks or jobs may be using its scheduler."""
        entry = live_entry(cluster_id, self.log)
        address = entry["scheduler_address"]
        if self.get_query_argument("forget", "") == "1":
            registry.unregister(cluster_id)
            message = f"forgot the cluster at {address}"
            self.finish(json.dumps({"id": cluster_id, "closed": False, "message": message}))
            return
        if entry["owns_cluster"] is not True:  # checked: a missing one reads false
            raise tornado.web.HTTPError(
                409,
                f"cluster {cluster_id} at {address} was joined with %monarch connect, not "
                "started by its notebook; shut it down where it was started (%monarch down "
                "in the notebook only leaves it)",
            )
        connection_args = _connection_args(address)
        if connection_args is None:
            raise tornado.web.HTTPError(
                409,
                f"cluster {cluster_id} at {address} speaks TLS and this Jupyter server holds "
                "none of its certificates (distributed.comm.tls in Dask's config); shut it "
                "down with %monarch down in its notebook",
            )
        closed, message = await close_scheduler(address, connection_args)
        registry.unregister(cluster_id)
        self.finish(json.dumps({"id": cluster_id, "closed": closed, "message": message}))


def _connection_args(address: str) -> dict[str, Any] | None:
    """What a Dask client here needs to reach ``address``; None for a TLS scheduler when Dask's
    config names no certificates (a cluster made with ``%monarch up --tls`` keeps its own in
    the notebook's memory)."""
    from distributed.security import Security

    args = Security().get_connection_args("client")
    if address.startswith(("tls://", "wss://")) and args.get("ssl_context") is None:
        return None
    return args


async def close_scheduler(
    address: str, connection_args: dict[str, Any] | None = None
) -> tuple[bool, str]:
    """Ask the scheduler at ``address`` to close (its workers go with it); never waits long."""
    from distributed.comm.core import CommClosedError
    from distributed.core import rpc

    from monarch_nb.controller import handshake

    handshake.bound_dask_handshakes()  # before any of Dask's comms here reads a stranger's size
    remote = rpc(address, timeout=CONNECT_TIMEOUT, connection_args=connection_args)
    try:
        await asyncio.wait_for(remote.terminate(), CLOSE_TIMEOUT)
    except handshake.NotDask as e:  # an SSH server, an HTTP one...: no bytes claimed were taken
        return False, f"{handshake.not_a_scheduler(address, handshake.said(e))}; forgot it anyway"
    except (CommClosedError, EOFError):
        pass  # the scheduler closed the connection as it went down: the outcome we asked for
    except (OSError, asyncio.TimeoutError) as e:
        why = str(e) or type(e).__name__  # a timeout says nothing
        return False, f"the scheduler at {address} did not answer ({why}); forgot it anyway"
    except Exception as e:  # something else listens there and sent what Dask cannot read
        why = f"{type(e).__name__}: {e}"
        return False, f"{address} answered, but not as a Dask scheduler ({why}); forgot it anyway"
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
        if not safe_path(path):
            raise tornado.web.HTTPError(400, "refusing dashboard path %r", path)
        entry = live_entry(cluster_id, self.log)
        headers = {
            name: self.request.headers[name]
            for name in _FORWARDED_HEADERS
            if name in self.request.headers
        }
        query = forwarded_query(self.request.query)
        try:
            response = await fetch_dashboard(entry, path, query, headers)
        except Gone as e:
            raise tornado.web.HTTPError(410, "%s", e) from None
        if not 200 <= response.code < 600:
            raise tornado.web.HTTPError(502, "the dashboard answered status %d", response.code)
        self.set_status(response.code)
        for name in _PASSED_HEADERS:
            if name in response.headers:
                self.set_header(name, response.headers[name])
        location = response.headers.get("Location")
        if location is not None:
            proxied = self._proxied_location(location, entry["dashboard_url"], path, cluster_id)
            if proxied is None:
                raise tornado.web.HTTPError(
                    502, "the dashboard redirected outside its own pages, to %r", location[:200]
                )
            self.set_header("Location", proxied)
        if response.code in (204, 304):
            self.finish()  # tornado refuses a body with these
        else:
            self.finish(response.body or b"")

    def _proxied_location(self, location: str, dashboard: str, path: str, cluster_id: str):
        """The dashboard's redirect as a URL below this cluster's proxy; None if it leads
        anywhere else (another host, or a path that climbs out once a browser reads it)."""
        target = urlsplit(urljoin(dashboard + path, location))
        if f"{target.scheme}://{target.netloc}/" != dashboard or not safe_path(target.path[1:]):
            return None
        base = url_path_join(self.base_url, "monarch/proxy", cluster_id)
        return f"{base}/{target.path[1:]}" + (f"?{target.query}" if target.query else "")
