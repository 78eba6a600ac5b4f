"""BokehJS from the installed ``bokeh`` package, for the lab extension's loader (bokehLoader.ts).

    GET /monarch/api/bokeh          {"version": "3.9.2", "files": ["bokeh.min.js", ...]}, in
                                    the order the page must run them
    GET /monarch/bokeh/<file>       one of exactly those files

jupyter_bokeh's widgets need ``window.Bokeh`` in the page, and bokeh's own notebook loader
fetches it from a CDN that offline clusters cannot reach. These routes serve the files of the
``bokeh`` the kernel's Python has installed, so the JavaScript always matches the version that
serialised the figures (BokehJS warns on a mismatch). Read-only, authenticated like the rest
of the API; no name outside the list is ever opened.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import tornado.web
from jupyter_server.base.handlers import APIHandler, JupyterHandler

INDEX_ROUTE = r"/monarch/api/bokeh/?"
FILE_ROUTE = r"/monarch/bokeh/([^/]+)"


@cache
def bokeh_files() -> dict[str, Path]:
    """``{file name: path}`` in load order: BokehJS first, then the bundles its notebook loader
    adds (gl, widgets, tables, mathjax), so any figure jupyter_bokeh sends finds its models."""
    from bokeh.resources import Resources
    from bokeh.util.paths import bokehjs_path

    js = bokehjs_path() / "js"
    return {f"{name}.min.js": js / f"{name}.min.js" for name in Resources(mode="inline").components}


def bokeh_version() -> str:
    import bokeh

    return bokeh.__version__


def handlers() -> list[tuple[str, type]]:
    """The routes, for server.py to register below the base URL."""
    return [(INDEX_ROUTE, BokehIndexHandler), (FILE_ROUTE, BokehFileHandler)]


class BokehIndexHandler(APIHandler):
    @tornado.web.authenticated
    def get(self):
        self.finish(json.dumps({"version": bokeh_version(), "files": list(bokeh_files())}))


class BokehFileHandler(JupyterHandler):
    """A script, not JSON; a request without credentials gets 403, never a login page."""

    def get_login_url(self) -> str:
        if not self.current_user:
            raise tornado.web.HTTPError(403, "authentication required")
        return super().get_login_url()

    @tornado.web.authenticated
    def get(self, name: str):
        path = bokeh_files().get(name)
        if path is None:
            raise tornado.web.HTTPError(404, "not a BokehJS file: %r", name)
        self.set_header("Content-Type", "text/javascript; charset=utf-8")
        # tornado's ETag answers an unchanged file with 304; a new bokeh changes the ETag
        self.set_header("Cache-Control", "private, no-cache")
        self.finish(path.read_bytes())
