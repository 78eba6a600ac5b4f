"""Which clusters the kernels of this machine have started: one JSON file per controller.

Each controller writes ``<jupyter runtime dir>/monarch-clusters/<id>.json`` (directory 0o700,
file 0o600) when its cluster is ready and removes it in ``down()``. The Jupyter server reads
these entries for the sidebar, and proxies only to the dashboards named here. An entry whose
controller process is gone (the kernel died or was killed) is dropped when listed.

An entry::

    {"id": "3f2c...", "scheduler_address": "tcp://127.0.0.1:40123",
     "dashboard_url": "http://127.0.0.1:8787/", "ranks": 2, "started": 1764467000.5,
     "pid": 4242, "pid_started": 1764466990.1, "kernel_id": "9d1e..." or None}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

DIRNAME = "monarch-clusters"
ID_PATTERN = re.compile(r"[0-9a-f]{32}")  # Controller.id is uuid4().hex
_KERNEL_FILE = re.compile(r"kernel-([0-9A-Za-z-]+)\.json")


def registry_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / DIRNAME


def valid_id(cluster_id: str) -> bool:
    return bool(ID_PATTERN.fullmatch(cluster_id))


def _ensure_dir() -> Path:
    path = registry_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # an existing directory may have been made with a looser umask
    return path


def kernel_id() -> str | None:
    """The id of the Jupyter kernel this process is, from its connection file's name."""
    if "ipykernel" not in sys.modules:
        return None
    try:
        from ipykernel.connect import get_connection_file

        path = get_connection_file()
    except Exception:  # not a running kernel app (plain IPython, a script importing ipykernel)
        return None
    m = _KERNEL_FILE.fullmatch(os.path.basename(path))
    return m.group(1) if m else None


def dashboard_base(link: str | None) -> str | None:
    """``http://host:port/status`` -> ``http://host:port/``: the root the proxy may reach."""
    if not link:
        return None
    parts = urlsplit(link)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}/"


def _process_started(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        # A killed kernel stays a zombie until the Jupyter server (its parent) reaps it: gone.
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return -1.0  # alive, owned by someone else: its start time cannot be read


def make_entry(ctl) -> dict[str, Any]:
    pid = os.getpid()
    try:
        link = ctl.client.dashboard_link
    except Exception:  # the scheduler runs no dashboard
        link = None
    return {
        "id": ctl.id,
        "scheduler_address": ctl.scheduler_address,
        "dashboard_url": dashboard_base(link),
        "ranks": ctl.world_size,
        "started": time.time(),
        "pid": pid,
        "pid_started": _process_started(pid),
        "kernel_id": kernel_id(),
        # False where the notebook joined a cluster (%monarch connect): the sidebar then
        # leaves its scheduler alone, since others may be using it
        "owns_cluster": bool(ctl.owns_cluster),
    }


def write_entry(entry: dict[str, Any]) -> Path:
    if not valid_id(entry["id"]):
        raise ValueError(f"cluster id must be 32 hex digits, got {entry['id']!r}")
    folder = _ensure_dir()
    path = folder / f"{entry['id']}.json"
    tmp = folder / f".{entry['id']}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)  # readers never see half an entry
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def register(ctl) -> Path | None:
    """Record ``ctl``'s cluster for the Jupyter server; None (and a log line) if the runtime
    directory cannot be written, which must not stop the cluster from working."""
    try:
        return write_entry(make_entry(ctl))
    except OSError as e:
        log.warning("monarch_nb: cannot record the cluster in %s: %s", registry_dir(), e)
        return None


def unregister(ctl_or_id) -> bool:
    """Remove the entry of a controller (or cluster id); True if there was one."""
    cluster_id = ctl_or_id if isinstance(ctl_or_id, str) else ctl_or_id.id
    if not valid_id(cluster_id):
        return False
    try:
        os.unlink(registry_dir() / f"{cluster_id}.json")
        return True
    except FileNotFoundError:
        return False


def alive(entry: dict[str, Any]) -> bool:
    """Whether the controller process that wrote ``entry`` still runs (not a reused pid)."""
    pid = entry.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    started = _process_started(pid)
    if started is None:
        return False
    recorded = entry.get("pid_started")
    if started < 0 or not isinstance(recorded, int | float) or recorded < 0:
        return True
    return abs(started - recorded) < 1.0


def read_entry(cluster_id: str) -> dict[str, Any] | None:
    if not valid_id(cluster_id):
        return None
    try:
        entry = json.loads((registry_dir() / f"{cluster_id}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("id") != cluster_id:
        return None
    return entry


def get_entry(cluster_id: str, prune: bool = True) -> dict[str, Any] | None:
    """The live entry for ``cluster_id``; a stale one is removed and None returned."""
    entry = read_entry(cluster_id)
    if entry is not None and prune and not alive(entry):
        unregister(cluster_id)
        return None
    return entry


def list_entries(prune: bool = True) -> list[dict[str, Any]]:
    """Every entry, oldest first; with ``prune``, entries of dead controllers (and unreadable
    files) are deleted and left out."""
    folder = registry_dir()
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    entries = []
    for name in names:
        stem, dot, ext = name.partition(".")
        if ext != "json" or not dot or not valid_id(stem):
            continue
        entry = read_entry(stem)
        if entry is None or (prune and not alive(entry)):
            if prune:
                unregister(stem)
            continue
        entries.append(entry)
    entries.sort(key=lambda e: e.get("started", 0))
    return entries
