"""The kept clusters (``%monarch up --keep``, kept.py) for the sidebar, which lists those no kernel
holds as "detached", with their owner and age, and can shut them down.

    GET    /monarch/api/kept        {"kept": [row, ...]}, every kept cluster of this user's here
    DELETE /monarch/api/kept/<id>   shut its host (and so its workers) down

A row carries no token, certificate or process id: only what the sidebar shows. The entries are
checked as the kernel checks them before attaching (owner, mode, no symlink, the host process
alive, this user's and listening on the scheduler's port); one that fails is named once in the
server's log and answered 404, and its process is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import time
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler

from monarch_nb import kept, registry

ROW_FIELDS = ("id", "name", "ranks", "devices", "started", "idle_limit", "detached_since")


def handlers() -> list[tuple[str, type]]:
    return [(r"/monarch/api/kept/?", KeptHandler), (r"/monarch/api/kept/([^/]+)/?", KeptCluster)]


def owner() -> str:
    with contextlib.suppress(KeyError):
        return pwd.getpwuid(os.geteuid()).pw_name
    return str(os.geteuid())


def row(entry: dict[str, Any], notebooks: dict[str, str]) -> dict[str, Any]:
    holder = entry["holder"]
    out = {key: entry[key] for key in ROW_FIELDS}
    out["owner"] = owner()
    out["state"] = "attached" if holder else "detached"
    out["age"] = max(0.0, time.time() - entry["started"])
    if holder:
        kernel = holder["kernel"]
        out["holder"] = {
            "kernel": kernel,
            "notebook": notebooks.get(kernel or "") or holder["notebook"],
            "since": holder["since"],
        }
    else:
        out["holder"] = None
    return out


class _Api(APIHandler):
    """Errors as one JSON message, and no request body on any route (413), as the other
    routes of the sidebar's API answer."""

    async def prepare(self):
        await super().prepare()
        if self.request.body:
            raise tornado.web.HTTPError(413, "the monarch API takes no request body")

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish(json.dumps({"message": message}))


class KeptHandler(_Api):
    @tornado.web.authenticated
    async def get(self):
        notebooks: dict[str, str] = {}
        with contextlib.suppress(Exception):  # the session list is a nicety, never a failure
            for session in await self.session_manager.list_sessions():
                notebooks[(session.get("kernel") or {}).get("id", "")] = session.get("path")
        rows = [row(e, notebooks) for e in kept.entries(self.log)]
        self.finish(json.dumps({"kept": rows}))


class KeptCluster(_Api):
    @tornado.web.authenticated
    async def delete(self, cluster_id: str):
        if not registry.valid_id(cluster_id):
            self.fail(400, "malformed cluster id: expected 32 hex digits")
            return
        try:
            entry = kept.load(cluster_id)
        except registry.InvalidEntry as e:
            registry.report(e, self.log)
            self.fail(404, f"kept cluster {cluster_id} is ignored: {e.reason} (see the server log)")
            return
        if entry is None:
            self.fail(404, f"no kept cluster with id {cluster_id} is running")
            return
        loop = asyncio.get_running_loop()
        stopped = await loop.run_in_executor(None, kept.stop_host, entry)
        name = entry["name"]
        message = (
            f"shut kept cluster {name} down"
            if stopped
            else f"kept cluster {name} was asked to shut down and has not yet"
        )
        self.finish(json.dumps({"id": cluster_id, "closed": stopped, "message": message}))
