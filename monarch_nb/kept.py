"""Kept clusters: those ``%monarch up --keep`` starts in a host process of their own (host/),
which outlive the kernel; one JSON file each, which the host writes and keeps up to date.

``<jupyter runtime dir>/monarch-kept/<id>.json`` (directory 0o700, file 0o600) is written by
the cluster's host once its workers are up, again whenever a kernel attaches or lets go, and
removed as it shuts down; ``<id>.log`` beside it is the host's log (its workers' output outside
cells too), kept where the host shut itself down, so that it says why. The kernel reads the
entry to attach (``%monarch attach``), the Jupyter server to list and shut down the clusters
no kernel holds. A host that finds its file deleted (or replaced) writes it again within a
second (host/lease.py), so that the cluster stays reachable until its idle limit.

A name is held by the host of the cluster it names: an exclusive ``flock`` on ``<name>.lock``
beside the entries (``claim_name``), taken by the kernel before the host starts and inherited
by the host, which keeps it open while it runs (and claims it again where the file is
deleted). Of two kernels asking for a name at once, one gets the lock and the other is refused
at once, before anything starts. A host that dies, even by SIGKILL, lets go of its lock with
its last descriptor: Linux drops it, so no claim outlives its host and no pid is read to tell;
one that shuts down also removes its lock file. An entry::

    {"id": "3f2c...", "name": "train", "scheduler_address": "tcp://127.0.0.1:40123",
     "dashboard_url": "http://127.0.0.1:40124/", "token": "9a0b...", "ranks": 2,
     "devices": "2 cpu", "started": 1764467000.5, "pid": 4242, "pid_started": 1764466990.1,
     "idle_limit": 7200.0, "dist": true, "group": ["host", 4242, 4242], "tls": null,
     "holder": {"kernel": "9d1e...", "notebook": "train.ipynb", "since": 1764467003.0},
     "detached_since": null, "ft": null}

Its address and token let whoever reads it drive the ranks, so nothing read back is trusted
until checked, as strictly as the registry's entries (registry.py): the directory and the file
are this user's and owner-only, the file is no symlink and is checked on its open descriptor;
every field has its type, and no others are kept; the host process it names is alive, this
user's, started when the entry says, and listens on the scheduler's port. An entry that fails
is skipped and reported once; one whose host is gone is stale and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import select
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from monarch_nb import registry

log = logging.getLogger(__name__)

DIRNAME = "monarch-kept"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TOKEN = re.compile(r"[0-9a-f]{32}")
MAX_TEXT = 1024  # a notebook's path, the devices' description
MAX_PEM = 16 * 1024
STOP_WAIT = 30.0  # seconds for a host to close its workers and exit once asked
TOPIC = "monarch-keep"  # the scheduler's event that tells a kernel it was taken over


def kept_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / DIRNAME


def ensure_dir() -> Path:
    return registry._ensure_dir(kept_dir())


def log_path(cluster_id: str) -> Path:
    return kept_dir() / f"{cluster_id}.log"


def write(entry: dict[str, Any]) -> Path:
    """The host's: ``entry`` written whole (a reader never sees half of it), owner-only."""
    return registry.write_entry(entry, kept_dir())


def remove(cluster_id: str) -> None:
    if registry.valid_id(cluster_id):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kept_dir() / f"{cluster_id}.json")


# -- names: one cluster each, held by its host ------------------------------------------------
def _name_path(name: str) -> Path:
    return kept_dir() / f"{name}.lock"  # never read as an entry: those are <32 hex>.json


def claim_name(name: str) -> int | None:
    """A descriptor of ``<name>.lock`` with an exclusive flock on it, which holds ``name`` for
    this process and those it hands the descriptor to; None where another holds it."""
    ensure_dir()
    path = _name_path(name)
    for _ in range(100):  # each turn, a holder letting go in between
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if holds_name(fd, name):
            return fd
        os.close(fd)  # its holder removed it as it let go: the file there now is the one
    return None


def holds_name(fd: int, name: str) -> bool:
    """Whether ``<name>.lock`` is still the file that ``fd`` locks (not deleted or replaced)."""
    try:
        there = os.stat(_name_path(name), follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def release_name(fd: int, name: str) -> None:
    """Let go of ``name``: its lock file removed while it is still held (a kernel that opened
    it meanwhile sees it gone and claims a new one), then the lock."""
    with contextlib.suppress(OSError):
        if holds_name(fd, name):
            os.unlink(_name_path(name))
    os.close(fd)


# -- reading: nothing is trusted until checked -------------------------------------------------
def _text(value, limit: int = MAX_TEXT) -> bool:
    return isinstance(value, str) and len(value) <= limit and value.isprintable()


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _time(value) -> bool:
    return registry._number(value) and value > 0


def _holder(raw) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("holder is not an object")
    kernel, notebook = raw.get("kernel"), raw.get("notebook")
    if kernel is not None and not (_text(kernel, 64) and registry._KERNEL_ID.fullmatch(kernel)):
        raise ValueError("holder.kernel is not a kernel id")
    if notebook is not None and not _text(notebook):
        raise ValueError("holder.notebook is not a path")
    if not _time(raw.get("since")):
        raise ValueError("holder.since is not a time")
    pid = raw.get("pid")
    if pid is not None and not (_count(pid) and pid > 0):
        raise ValueError("holder.pid is not a process id")
    return {"kernel": kernel, "notebook": notebook, "pid": pid, "since": raw["since"]}


def holder_text(holder: dict[str, Any]) -> str:
    """``kernel 9d1e... (train.ipynb)``, or the process of a controller outside Jupyter."""
    if holder.get("kernel"):
        where = f" ({holder['notebook']})" if holder.get("notebook") else ""
        return f"kernel {holder['kernel']}{where}"
    return f"process {holder.get('pid')} (not a Jupyter kernel)"


def _tls(raw) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"ca", "cert", "key"}:
        raise ValueError("tls is not {ca, cert, key}")
    for key, pem in raw.items():
        if not (isinstance(pem, str) and len(pem) <= MAX_PEM and pem.startswith("-----BEGIN")):
            raise ValueError(f"tls.{key} is not a PEM block")
    return dict(raw)


def parse(data: bytes, cluster_id: str) -> dict[str, Any]:
    """The entry in ``data`` with exactly the known fields, each checked; raises ValueError
    saying which field is wrong."""
    raw = registry.json_entry(data, cluster_id)
    name, address = raw.get("name"), raw.get("scheduler_address")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError("name is not a cluster name")
    host = registry._host(address, registry._SCHEDULER)
    if host is None:
        raise ValueError("scheduler_address is not tcp|tls|ws|wss://HOST:PORT")
    dashboard = raw.get("dashboard_url")
    if dashboard is not None and registry._host(dashboard, registry._DASHBOARD) != host:
        raise ValueError("dashboard_url is not http(s)://HOST[:PORT]/ on the scheduler's host")
    if not (isinstance(raw.get("token"), str) and _TOKEN.fullmatch(raw["token"])):
        raise ValueError("token is not 32 hex digits")
    pid, group = raw.get("pid"), raw.get("group")
    if not (_count(pid) and pid > 0):
        raise ValueError("pid is not a process id")
    for key in ("started", "pid_started", "idle_limit"):
        if not _time(raw.get(key)):
            raise ValueError(f"{key} is not a positive number")
    if not _count(raw.get("ranks")) or not _text(raw.get("devices")):
        raise ValueError("ranks or devices is missing")
    if not isinstance(raw.get("dist"), bool):
        raise ValueError("dist is not true or false")
    if not (
        isinstance(group, list)
        and len(group) == 3
        and _text(group[0], 255)
        and all(_count(g) for g in group[1:])
    ):
        raise ValueError("group is not [host, process group, pid]")
    detached = raw.get("detached_since")
    if detached is not None and not _time(detached):
        raise ValueError("detached_since is not a time")
    return {
        "id": cluster_id,
        "name": name,
        "scheduler_address": address,
        "dashboard_url": dashboard,
        "token": raw["token"],
        "ranks": raw["ranks"],
        "devices": raw["devices"],
        "started": raw["started"],
        "pid": pid,
        "pid_started": raw["pid_started"],
        "idle_limit": raw["idle_limit"],
        "dist": raw["dist"],
        "group": list(group),
        "tls": _tls(raw.get("tls")),
        "holder": _holder(raw.get("holder")),
        "detached_since": detached,
        "ft": _ft(raw.get("ft")),
    }


def _ft(value: Any) -> dict[str, Any] | None:
    """--ft: where the cluster's Lighthouse listens, and its pid (a child of the host)."""
    if value is None:
        return None
    if not (
        isinstance(value, dict)
        and set(value) == {"address", "pid"}
        and _text(value["address"], 300)
        and re.fullmatch(r"http://[^\s/]+:\d{1,5}", value["address"])
        and _count(value["pid"])
        and value["pid"] > 0
    ):
        raise ValueError("ft is not {address: http://HOST:PORT, pid}")
    return {"address": value["address"], "pid": value["pid"]}


def check_host(entry: dict[str, Any]) -> None:
    """Raises StaleEntry if the host is gone (or its pid reused), ValueError if the process is
    not this user's or does not listen on the scheduler's port (the address is not its)."""
    registry.check_process(entry)
    port = int(entry["scheduler_address"].rsplit(":", 1)[1])
    try:
        sockets = psutil.Process(entry["pid"]).net_connections(kind="inet")
    except psutil.NoSuchProcess:
        raise registry.StaleEntry(f"pid {entry['pid']} is gone") from None
    except psutil.AccessDenied:
        raise ValueError(f"the sockets of pid {entry['pid']} cannot be inspected") from None
    if not any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets):
        raise ValueError(f"pid {entry['pid']} does not listen on port {port} (its scheduler's)")


def _load(dir_fd: int, cluster_id: str) -> dict[str, Any]:
    name = f"{cluster_id}.json"
    data = registry._read_file(dir_fd, name, kept_dir())
    try:
        entry = parse(data, cluster_id)
        check_host(entry)
    except ValueError as e:
        raise registry.InvalidEntry(kept_dir() / name, str(e), (hash(data),)) from None
    return entry


def entries(logger: logging.Logger | None = None) -> list[dict[str, Any]]:
    """Every kept cluster of this user's that is running here, checked, oldest first. Files
    not to be trusted are reported once to ``logger`` and left alone; those of hosts that are
    gone are removed."""
    try:
        dir_fd = registry._open_dir(kept_dir())
    except registry.InvalidEntry as e:
        registry.report(e, logger or log)
        return []
    if dir_fd is None:
        return []
    found = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            stem, dot, ext = name.partition(".")
            if ext != "json" or not dot or not registry.valid_id(stem):
                continue
            try:
                found.append(_load(dir_fd, stem))
            except FileNotFoundError:
                continue  # removed since it was listed: its host shut down
            except registry.InvalidEntry as e:
                registry.report(e, logger or log)
            except registry.StaleEntry:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return sorted(found, key=lambda e: e["started"])


def load(cluster_id: str) -> dict[str, Any] | None:
    """The checked entry of ``cluster_id``; None where there is none (or its host is gone);
    raises registry.InvalidEntry, saying why, for one not to be trusted."""
    if not registry.valid_id(cluster_id):
        return None
    dir_fd = registry._open_dir(kept_dir())
    if dir_fd is None:
        return None
    try:
        return _load(dir_fd, cluster_id)
    except (FileNotFoundError, registry.StaleEntry):
        return None
    finally:
        os.close(dir_fd)


def find(name: str) -> dict[str, Any] | registry.InvalidEntry | None:
    """The checked entry named ``name``; the reason it is not to be trusted where the only
    file of that name fails its checks; None where no kept cluster has that name."""
    refused = None
    try:
        dir_fd = registry._open_dir(kept_dir())
    except registry.InvalidEntry as e:
        return e
    if dir_fd is None:
        return None
    try:
        for file in sorted(os.listdir(dir_fd)):
            stem, _, ext = file.partition(".")
            if ext != "json" or not registry.valid_id(stem):
                continue
            try:
                entry = _load(dir_fd, stem)
            except registry.InvalidEntry as e:
                if _claimed_name(kept_dir() / file) == name:
                    refused = e
                continue
            except (FileNotFoundError, registry.StaleEntry):
                continue
            if entry["name"] == name:
                return entry
    finally:
        os.close(dir_fd)
    return refused


def _claimed_name(path: Path) -> str | None:
    """The name a file that failed its checks gives itself, only to say why that name is
    refused (nothing else of it is used)."""
    with contextlib.suppress(Exception), open(path, "rb") as f:
        return json.loads(f.read(registry.MAX_ENTRY_BYTES)).get("name")
    return None


# -- shutting a host down ----------------------------------------------------------------------
def stop_host(entry: dict[str, Any], wait: float = STOP_WAIT) -> bool:
    """Ask the host of a checked entry to shut its cluster down (SIGTERM, through a pidfd
    opened before its start time is checked again, so that a pid reused meanwhile is never
    signalled), and wait up to ``wait`` seconds for it to exit; whether it did."""
    pid = entry["pid"]
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        try:
            registry.check_process(entry)
        except registry.StaleEntry:
            return True
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if select.select([fd], [], [], min(0.2, max(0.0, deadline - time.monotonic())))[0]:
                return True
        return False
    except ProcessLookupError:
        return True
    finally:
        os.close(fd)
