"""What the server extension's tests share: fake controllers in the registry, a small web
server on loopback, and reading a response whatever its status."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from types import SimpleNamespace

import tornado.web
from tornado.httpclient import HTTPClientError
from tornado.httpserver import HTTPServer

from monarch_nb import registry

NO_TOKEN = {"Authorization": ""}


def fake_controller(
    dashboard_link="http://127.0.0.1:1/status", address="tcp://127.0.0.1:1", owns_cluster=True
):
    client = SimpleNamespace(dashboard_link=dashboard_link)
    return SimpleNamespace(
        id=uuid.uuid4().hex,
        client=client,
        scheduler_address=address,
        world_size=2,
        owns_cluster=owns_cluster,
    )


def register(
    dashboard_link="http://127.0.0.1:1/status", address="tcp://127.0.0.1:1", owns_cluster=True
) -> str:
    ctl = fake_controller(dashboard_link, address, owns_cluster)
    assert registry.register(ctl) is not None
    return ctl.id


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app: tornado.web.Application) -> tuple[str, HTTPServer]:
    """``app`` on 127.0.0.1, a port the OS picks, on the running loop: (its URL, the server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    server = HTTPServer(app)
    server.add_socket(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/", server


async def status_of(fetch, *parts, **kw) -> tuple[int, dict]:
    """(status, JSON body) whether or not the status is an error."""
    try:
        response = await fetch(*parts, **kw)
    except HTTPClientError as e:
        response = e.response
        assert response is not None, f"no response: {e}"
    body = response.body.decode() if response.body else ""
    try:
        return response.code, json.loads(body) if body else {}
    except ValueError:
        return response.code, {"text": body}
