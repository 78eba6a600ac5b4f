"""The Jupyter server's BokehJS routes (bokeh_static.py) against a real Jupyter server."""

from __future__ import annotations

import json

import bokeh
import pytest
from bokeh.util.paths import bokehjs_path
from tornado.httpclient import HTTPClientError

pytest_plugins = ["pytest_jupyter.jupyter_server"]

NO_TOKEN = {"Authorization": ""}


async def status_of(fetch, *parts, **kw):
    try:
        response = await fetch(*parts, **kw)
    except HTTPClientError as e:
        response = e.response
        assert response is not None, f"no response: {e}"
    return response.code, response


async def test_the_index_lists_the_installed_bokeh_in_load_order(jp_fetch):
    code, response = await status_of(jp_fetch, "monarch", "api", "bokeh")
    assert code == 200
    assert json.loads(response.body) == {
        "version": bokeh.__version__,
        # what bokeh's own notebook loader puts in a page, BokehJS first
        "files": [
            "bokeh.min.js",
            "bokeh-gl.min.js",
            "bokeh-widgets.min.js",
            "bokeh-tables.min.js",
            "bokeh-mathjax.min.js",
        ],
    }


async def test_each_listed_file_is_the_installed_one(jp_fetch):
    _, index = await status_of(jp_fetch, "monarch", "api", "bokeh")
    for name in json.loads(index.body)["files"]:
        code, response = await status_of(jp_fetch, "monarch", "bokeh", name)
        assert code == 200, name
        assert response.headers["Content-Type"].startswith("text/javascript")
        assert response.body == (bokehjs_path() / "js" / name).read_bytes()


@pytest.mark.parametrize(
    "name", ["bokeh.js", "bokeh-api.min.js", "compiler.js", "..%2F__init__.py", "%2Fetc%2Fpasswd"]
)
async def test_nothing_else_is_served(jp_fetch, name):
    code, _ = await status_of(jp_fetch, "monarch", "bokeh", name)
    assert code == 404


@pytest.mark.parametrize("parts", [("api", "bokeh"), ("bokeh", "bokeh.min.js")])
async def test_without_a_token_is_403(jp_fetch, parts):
    code, response = await status_of(jp_fetch, "monarch", *parts, headers=NO_TOKEN)
    assert code == 403
    assert b"Bokeh" not in response.body
    code, _ = await status_of(jp_fetch, "monarch", *parts, headers={"Authorization": "token wrong"})
    assert code == 403


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_the_routes_are_read_only(jp_fetch, method):
    body = None if method == "DELETE" else b"{}"
    for parts in (("api", "bokeh"), ("bokeh", "bokeh.min.js")):
        code, _ = await status_of(jp_fetch, "monarch", *parts, method=method, body=body)
        assert code == 405, (method, parts)
