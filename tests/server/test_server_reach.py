"""Which registered clusters the sidebar lists: those whose dashboard answers this Jupyter
server. The others, live controllers all the same (a stopped process, one in another network
namespace, a dashboard that never answered), come with why, in one line, instead of a listed
cluster whose metrics answer 410 Gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import tornado.web
from _server_helpers import closed_port, register, serve, status_of

from monarch_nb import registry

pytest_plugins = ["pytest_jupyter.jupyter_server"]

# Another kernel's controller, as far as the server can tell: a process of this user with a
# cluster's scheduler (and its dashboard routes) in it, registered under its own pid.
CONTROLLER = """
import asyncio, uuid
from types import SimpleNamespace
from distributed import Scheduler
from monarch_nb import registry
from monarch_nb.telemetry import dashboard

async def main():
    s = await Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0")
    await dashboard.DashboardPlugin().start(s)
    client = SimpleNamespace(dashboard_link=f"http://127.0.0.1:{s.http_server.port}/status")
    ctl = SimpleNamespace(id=uuid.uuid4().hex, client=client, scheduler_address=s.address,
                          world_size=0, owns_cluster=True)
    assert registry.register(ctl) is not None
    print(ctl.id, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def clusters(jp_fetch) -> dict:
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters")
    assert code == 200, body
    return body


@pytest.fixture
def other_controller(runtime):
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


async def test_a_stopped_controller_is_left_out_with_why_until_it_continues(
    jp_fetch, other_controller
):
    proc, cluster_id = other_controller
    assert [r["id"] for r in (await clusters(jp_fetch))["clusters"]] == [cluster_id]
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
    assert code == 200 and body["state"] == "up", body
    os.kill(proc.pid, signal.SIGSTOP)  # Ctrl-Z in the terminal its IPython runs in, say
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "the controller did not stop"
            time.sleep(0.05)
        body = await clusters(jp_fetch)
        assert body["clusters"] == [], body
        (left_out,) = body["unreachable"]
        assert left_out["id"] == cluster_id and left_out["pid"] == proc.pid
        why = f"its process (pid {proc.pid}) is stopped; its scheduler answers once it continues"
        assert left_out["why"].startswith(why) and "\n" not in left_out["why"]
        code, body = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
        assert code == 410 and body["message"].startswith(why), body
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    body = await clusters(jp_fetch)
    assert [r["id"] for r in body["clusters"]] == [cluster_id] and body["unreachable"] == []


async def test_a_dashboard_that_never_answered_is_left_out_with_why(jp_fetch, runtime):
    port = closed_port()
    silent = register(f"http://127.0.0.1:{port}/status", f"tcp://127.0.0.1:{port}")
    without = register(None, "tcp://127.0.0.1:1")  # a scheduler run without a dashboard
    body = await clusters(jp_fetch)
    assert body["clusters"] == []
    why = {row["id"]: row["why"] for row in body["unreachable"]}
    assert f"http://127.0.0.1:{port}/ does not answer" in why[silent], why
    assert why[without] == (
        "its scheduler runs no dashboard, where the sidebar reads a cluster's metrics"
    )


async def test_a_cluster_that_answered_once_stays_listed_and_is_said_gone(jp_fetch, runtime):
    """Its scheduler died while its kernel lives on: listed, so that the sidebar says it is
    gone and offers to forget it."""

    class Metrics(tornado.web.RequestHandler):
        def get(self):
            self.write({"time": 0, "workers": [], "metrics": {}})

    url, server = serve(tornado.web.Application([(r"/monarch/metrics.json", Metrics)]))
    cluster_id = register(url + "status", "tcp://127.0.0.1:1")
    assert [r["id"] for r in (await clusters(jp_fetch))["clusters"]] == [cluster_id]
    server.stop()
    assert [r["id"] for r in (await clusters(jp_fetch))["clusters"]] == [cluster_id]
    code, body = await status_of(jp_fetch, "monarch", "api", "clusters", cluster_id, "metrics")
    assert code == 410 and body["state"] == "gone", body


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
async def test_a_controller_in_another_network_namespace_is_left_out_with_why(jp_fetch, runtime):
    try:
        other = subprocess.Popen(["unshare", "--net", "sleep", "60"], stderr=subprocess.PIPE)
    except OSError as e:
        pytest.skip(f"unshare cannot run here: {e}")
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{other.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if other.poll() is not None:
                pytest.skip(f"unshare --net failed: {other.stderr.read().decode().strip()}")
            assert time.monotonic() < deadline, "unshare did not enter a network namespace"
            time.sleep(0.05)
        cluster_id = register("http://127.0.0.1:1/status", "tcp://127.0.0.1:1")
        path = runtime / "monarch-clusters" / f"{cluster_id}.json"
        entry = json.loads(path.read_text())
        entry.update(pid=other.pid, pid_started=psutil.Process(other.pid).create_time())
        registry.write_entry(entry)
        (left_out,) = (await clusters(jp_fetch))["unreachable"]
        assert left_out["why"] == (
            f"its process (pid {other.pid}) runs in another network namespace (a container?), "
            "whose 127.0.0.1 is not this server's"
        )
    finally:
        other.kill()
        other.wait()
        other.stderr.close()
