"""Kept-cluster files (kept.py) are trusted only once checked, by the kernel that attaches and by
the Jupyter server that lists them and shuts them down: forged or foreign files are refused,
named, left alone, and their processes never signalled. A real ``jupyter server``
(pytest-jupyter) and a small process standing in for a host: it listens on a port, as a
host's scheduler does, and exits on SIGTERM, as a host does."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from _server_helpers import NO_TOKEN, dead_pid, status_of
from _wait import running, wait_for

import monarch_nb
from monarch_nb import kept
from monarch_nb.errors import ClusterError

pytest_plugins = ["pytest_jupyter.jupyter_server"]
NOBODY = 65534
LISTEN = (
    "import socket, time; s = socket.create_server(('127.0.0.1', 0)); "
    "print(s.getsockname()[1], flush=True); time.sleep(120)"
)


@pytest.fixture
def host():
    """A live process of ours listening on a port: ``(process, port)``."""
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait()


def entry_for(pid: int, port: int, **changes) -> dict:
    entry = {
        "id": uuid.uuid4().hex,
        "name": "forged",
        "scheduler_address": f"tcp://127.0.0.1:{port}",
        "dashboard_url": None,
        "token": uuid.uuid4().hex,
        "ranks": 2,
        "devices": "2 cpu",
        "started": time.time(),
        "pid": pid,
        "pid_started": psutil.Process(pid).create_time(),
        "idle_limit": 7200.0,
        "dist": True,
        "group": ["host", pid, pid],
        "tls": None,
        "holder": None,
        "detached_since": time.time(),
        "ft": None,
    }
    return {**entry, **changes}


def test_a_checked_file_is_listed_and_its_host_shut_down(runtime, host):
    proc, port = host
    entry = entry_for(proc.pid, port, name="good")
    kept.write(entry)
    (listed,) = kept.entries()
    assert listed == entry
    assert kept.find("good") == entry and kept.load(entry["id"]) == entry
    assert os.stat(kept.kept_dir() / f"{entry['id']}.json").st_mode & 0o777 == 0o600
    assert os.stat(kept.kept_dir()).st_mode & 0o777 == 0o700
    assert kept.stop_host(entry, wait=30)
    assert proc.wait(10) == -signal.SIGTERM


def _mutations(tmp_path):
    """name -> (how the file is tampered with, what the refusal says)."""

    def mode(path):
        os.chmod(path, 0o644)

    def symlink(path):
        target = tmp_path / "elsewhere.json"
        os.replace(path, target)
        os.symlink(target, path)

    def foreign_file(path):
        os.chown(path, NOBODY, NOBODY)

    return {
        "group-readable": (mode, "the entry's mode is 644, not owner-only 600"),
        "symlink": (symlink, "the entry is a symlink"),
        "another user's file": (foreign_file, f"the entry is owned by uid {NOBODY}"),
    }


@pytest.mark.parametrize("case", ["group-readable", "symlink", "another user's file"])
def test_a_tampered_file_is_refused_named_and_left_alone(runtime, host, tmp_path, case, caplog):
    proc, port = host
    entry = entry_for(proc.pid, port)
    path = kept.write(entry)
    tamper, reason = _mutations(tmp_path)[case]
    tamper(path)
    assert kept.entries() == []
    assert any(reason in r.getMessage() for r in caplog.records)
    with pytest.raises(ClusterError, match=f"kept cluster forged is not to be trusted: {reason}"):
        monarch_nb.attach("forged", current=False)
    assert os.path.lexists(path) and running([proc.pid]) == [proc.pid]


def _other_users_process():
    proc = subprocess.Popen(["sleep", "120"], user=NOBODY)
    wait_for(lambda: psutil.Process(proc.pid).uids().real == NOBODY, timeout=10)
    return proc


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda e, p: {**e, "token": "abc"}, "token is not 32 hex digits"),
        (lambda e, p: {**e, "name": "../x"}, "name is not a cluster name"),
        (lambda e, p: {**e, "scheduler_address": "inproc://x"}, "scheduler_address is not"),
        (lambda e, p: {**e, "tls": {"ca": "x", "cert": "y", "key": "z"}}, "tls.ca is not a PEM"),
        (lambda e, p: {**e, "holder": {"kernel": "../k", "since": 1}}, "holder.kernel is not"),
        (lambda e, p: {**e, "ft": {"address": "http://h:1/x", "pid": 1}}, "ft is not"),
        (lambda e, p: {**e, "pid_started": e["pid_started"] + 100}, "is another process now"),
        (lambda e, p: {**e, "scheduler_address": "tcp://127.0.0.1:1"}, "does not listen on port 1"),
        ("other user", f"belongs to uid {NOBODY}"),
    ],
)
def test_a_forged_file_is_refused(runtime, host, forge, reason):
    proc, port = host
    other = _other_users_process() if forge == "other user" else None
    try:
        if other is not None:
            entry = entry_for(other.pid, port)
        else:
            entry = forge(entry_for(proc.pid, port), proc)
        kept.write(entry)
        assert kept.entries() == []
        if "another process" in reason:  # stale: the file is removed, the process left alone
            assert not (kept.kept_dir() / f"{entry['id']}.json").exists()
            return
        with pytest.raises(ClusterError, match="is not to be trusted: .*" + reason.split(" (")[0]):
            monarch_nb.attach(entry["name"], current=False)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    assert running([proc.pid]) == [proc.pid]


def test_the_file_of_a_dead_host_is_removed(runtime, host):
    _, port = host
    entry = entry_for(os.getpid(), port)
    entry["pid"] = dead_pid()
    kept.write(entry)
    assert kept.entries() == [] and kept.load(entry["id"]) is None
    assert not (kept.kept_dir() / f"{entry['id']}.json").exists()


# -- the sidebar's routes -----------------------------------------------------------------------
async def test_the_kept_route_lists_rows_without_secrets_and_shuts_one_down(
    jp_fetch, runtime, host
):
    proc, port = host
    entry = entry_for(proc.pid, port, name="detached-one")
    kept.write(entry)
    code, body = await status_of(jp_fetch, "monarch", "api", "kept", headers=NO_TOKEN)
    assert code == 403
    code, body = await status_of(jp_fetch, "monarch", "api", "kept")
    assert code == 200
    (row,) = body["kept"]
    assert (row["name"], row["state"], row["owner"], row["ranks"]) == (
        "detached-one",
        "detached",
        pwd.getpwuid(os.geteuid()).pw_name,
        2,
    )
    assert not {"token", "tls", "pid", "pid_started", "group"} & set(row)
    assert entry["token"] not in json.dumps(body)
    code, body = await status_of(jp_fetch, "monarch", "api", "kept", entry["id"], method="DELETE")
    assert (code, body["closed"]) == (200, True), body
    assert proc.wait(10) == -signal.SIGTERM


async def test_the_kept_route_never_signals_the_process_of_a_refused_file(jp_fetch, runtime, host):
    proc, port = host
    entry = entry_for(proc.pid, port)
    path = kept.write(entry)
    os.chmod(path, 0o640)
    code, body = await status_of(jp_fetch, "monarch", "api", "kept")
    assert (code, body) == (200, {"kept": []})
    code, body = await status_of(jp_fetch, "monarch", "api", "kept", entry["id"], method="DELETE")
    assert code == 404 and "not owner-only 600" in body["message"]
    code, body = await status_of(jp_fetch, "monarch", "api", "kept", "nope", method="DELETE")
    assert code == 400
    time.sleep(0.2)
    assert proc.poll() is None
