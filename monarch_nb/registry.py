"""Which clusters the kernels of this machine have started: one JSON file per controller.

Each controller writes ``<jupyter runtime dir>/monarch-clusters/<id>.json`` (directory 0o700,
file 0o600) when its cluster is ready and removes it in ``down()``. The Jupyter server reads
these entries for the sidebar, and proxies only to the dashboards named here. An entry whose
controller process is gone (the kernel died or was killed) is dropped when listed.

An entry::

    {"id": "3f2c...", "scheduler_address": "tcp://127.0.0.1:40123",
     "dashboard_url": "http://127.0.0.1:8787/", "ranks": 2, "started": 1764467000.5,
     "pid": 4242, "pid_started": 1764466990.1, "kernel_id": "9d1e..." or None,
     "owns_cluster": true}

Nothing read back is trusted until checked (``load_entry``), since the entry decides where the
server's proxy connects and which scheduler the sidebar's "Shut down" closes:

- the directory and the file are owned by this process's user and not a symlink (the file is
  opened with O_NOFOLLOW and checked through the open descriptor, so it cannot be swapped
  between the check and the read); the directory has no group/other write bit, the file no
  group/other bit at all; the file is a regular file of at most 64 KiB;
- every field has its type; ``owns_cluster`` must be a boolean, and a missing one is false;
- ``scheduler_address`` is ``tcp|tls|ws|wss://HOST:PORT`` and ``dashboard_url`` is
  ``http(s)://HOST[:PORT]/`` with the same HOST: the dashboard is served by the entry's own
  scheduler, so a URL on any other host is not that cluster's and is refused;
- the controller process it names is alive, this user's, and started at ``pid_started``
  (within a second; a missing start time is invalid, so a long-lived pid such as 1 cannot
  stand in for it).

An entry that fails is skipped and reported once (``report``); it is never deleted, since it
is not ours to trust. An entry whose controller is gone or whose pid was reused is stale and
is deleted when pruning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

DIRNAME = "monarch-clusters"
ID_PATTERN = re.compile(r"[0-9a-f]{32}")  # Controller.id is uuid4().hex
MAX_ENTRY_BYTES = 64 * 1024  # an entry is ~400 bytes
_KERNEL_FILE = re.compile(r"kernel-([0-9A-Za-z-]+)\.json")
_KERNEL_ID = re.compile(r"[0-9A-Za-z-]{1,64}")
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)"  # an IPv6 literal, an IPv4 address or a name
_PORT = r"([0-9]{1,5})"
# Dask's network comms; inproc:// and ucx:// are not reachable from the Jupyter server
_SCHEDULER = re.compile(rf"(tcp|tls|ws|wss)://{_HOST}:{_PORT}")
_DASHBOARD = re.compile(rf"(http|https)://{_HOST}(?::{_PORT})?/")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class InvalidEntry(ValueError):
    """An entry (or the registry directory) that is not to be trusted; says which and why."""

    def __init__(self, path: Path, reason: str, key: tuple = ()):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason
        self.key = (str(path), reason, *key)  # the same file unchanged is reported once


class StaleEntry(Exception):
    """The controller that wrote the entry is gone (or its pid now names another process)."""


def registry_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / DIRNAME


def valid_id(cluster_id: str) -> bool:
    return isinstance(cluster_id, str) and bool(ID_PATTERN.fullmatch(cluster_id))


def _ensure_dir(path: Path | None = None) -> Path:
    path = path or registry_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    # through a descriptor: a symlink put in its place fails here (ELOOP) instead of having
    # its target's mode changed and our entries written there
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o700)  # made earlier with a looser umask, maybe
    finally:
        os.close(fd)
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


def _host(address: str | None, pattern: re.Pattern) -> str | None:
    m = pattern.fullmatch(address) if isinstance(address, str) else None
    if m is None:
        return None
    port = m.group(3)
    if port is not None and not 0 < int(port) < 65536:
        return None
    return m.group(2).lower()


def dashboard_for(link: str | None, scheduler_address: str) -> str | None:
    """The dashboard root to record for a scheduler: None where the link is not on the
    scheduler's own host (a ``distributed.dashboard.link`` pointing at a proxy, say), since
    readers refuse such an entry."""
    base = dashboard_base(link)
    host = _host(base, _DASHBOARD)
    if host is None or host != _host(scheduler_address, _SCHEDULER):
        return None
    return base


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
        "dashboard_url": dashboard_for(link, ctl.scheduler_address),
        "ranks": ctl.world_size,
        "started": getattr(ctl, "started", None) or time.time(),  # kept when written again
        "pid": pid,
        "pid_started": _process_started(pid),
        "kernel_id": kernel_id(),
        # False where the notebook joined a cluster (%monarch connect): the sidebar then
        # leaves its scheduler alone, since others may be using it
        "owns_cluster": bool(ctl.owns_cluster),
    }


def write_entry(entry: dict[str, Any], folder: Path | None = None) -> Path:
    """Write ``entry`` as ``<id>.json`` in the registry (or ``folder``, kept.py's), whole or
    not at all, owner-only."""
    if not valid_id(entry["id"]):
        raise ValueError(f"cluster id must be 32 hex digits, got {entry['id']!r}")
    folder = _ensure_dir(folder)
    path = folder / f"{entry['id']}.json"
    tmp = folder / f".{entry['id']}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a process killed mid-write whose pid this one reuses
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
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
    directory cannot be written, or the entry would not pass a reader's checks (an address
    the server cannot reach), which must not stop the cluster from working."""
    entry = make_entry(ctl)
    try:
        parse_entry(json.dumps(entry).encode(), entry["id"])
    except ValueError as e:
        log.warning("monarch_nb: the JupyterLab sidebar will not list this cluster: %s", e)
        return None
    try:
        return write_entry(entry)
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


# -- reading: nothing is trusted until checked -------------------------------------------------
def _open_dir(folder: Path | None = None) -> int | None:
    """A descriptor of the registry directory (or ``folder``, kept.py's), checked; None if
    there is none."""
    folder = folder or registry_dir()
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file
        raise InvalidEntry(folder, f"cannot open the registry directory ({e.strerror})") from None
    st = os.fstat(fd)
    reason = None
    if st.st_uid != os.geteuid():
        reason = f"the registry directory is owned by uid {st.st_uid}, not {os.geteuid()}"
    elif st.st_mode & 0o022:
        reason = f"the registry directory is writable by others (mode {st.st_mode & 0o777:o})"
    if reason:
        os.close(fd)
        raise InvalidEntry(folder, reason, (st.st_ino, st.st_mtime_ns))
    return fd


def _read_file(dir_fd: int, name: str, folder: Path | None = None) -> bytes:
    """The bytes of one entry file, after checking the open descriptor (no check-then-read
    race); raises FileNotFoundError or InvalidEntry."""
    path = (folder or registry_dir()) / name
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink
        what = "a symlink" if os.path.islink(path) else f"unreadable ({e.strerror})"
        raise InvalidEntry(path, f"the entry is {what}") from None
    try:
        st = os.fstat(fd)
        key = (st.st_ino, st.st_mtime_ns)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidEntry(path, "the entry is not a regular file", key)
        if st.st_uid != os.geteuid():
            raise InvalidEntry(
                path, f"the entry is owned by uid {st.st_uid}, not {os.geteuid()}", key
            )
        if st.st_mode & 0o077:
            raise InvalidEntry(
                path, f"the entry's mode is {st.st_mode & 0o777:o}, not owner-only 600", key
            )
        data = b""
        while len(data) <= MAX_ENTRY_BYTES:
            chunk = os.read(fd, MAX_ENTRY_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > MAX_ENTRY_BYTES:
            raise InvalidEntry(path, f"the entry is larger than {MAX_ENTRY_BYTES} bytes", key)
        return data
    finally:
        os.close(fd)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def json_entry(data: bytes, cluster_id: str) -> dict[str, Any]:
    """The JSON object in ``data`` whose ``id`` is ``cluster_id`` (its file's name), its fields
    unchecked; raises ValueError saying what is wrong (kept.py's entries start so too)."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError("the entry is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ValueError("the entry is not a JSON object")
    if raw.get("id") != cluster_id:
        raise ValueError("its id is not its file's name")
    return raw


def parse_entry(data: bytes, cluster_id: str) -> dict[str, Any]:
    """The entry in ``data`` with exactly the known fields, each checked; raises ValueError
    saying which field is wrong."""
    raw = json_entry(data, cluster_id)
    address = raw.get("scheduler_address")
    host = _host(address, _SCHEDULER)
    if host is None:
        raise ValueError("scheduler_address is not tcp|tls|ws|wss://HOST:PORT")
    dashboard = raw.get("dashboard_url")
    if dashboard is not None:
        if _host(dashboard, _DASHBOARD) is None:
            raise ValueError("dashboard_url is not http(s)://HOST[:PORT]/")
        if _host(dashboard, _DASHBOARD) != host:
            raise ValueError("dashboard_url is not on the scheduler's host")
    ranks, pid, owns = raw.get("ranks"), raw.get("pid"), raw.get("owns_cluster", False)
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 0):
        raise ValueError("ranks is not a count")
    if not _number(raw.get("started")):
        raise ValueError("started is not a time")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0):
        raise ValueError("pid is not a process id")
    if not (_number(raw.get("pid_started")) and raw["pid_started"] > 0):
        raise ValueError(f"it gives no start time for pid {pid}")
    kernel = raw.get("kernel_id")
    if kernel is not None and not (isinstance(kernel, str) and _KERNEL_ID.fullmatch(kernel)):
        raise ValueError("kernel_id is not a kernel id")
    if not isinstance(owns, bool):
        raise ValueError("owns_cluster is not true or false")
    return {
        "id": cluster_id,
        "scheduler_address": address,
        "dashboard_url": dashboard,
        "ranks": ranks,
        "started": raw["started"],
        "pid": pid,
        "pid_started": raw["pid_started"],
        "kernel_id": kernel,
        "owns_cluster": owns,
    }


def check_process(entry: dict[str, Any]) -> None:
    """Raises StaleEntry if the controller is gone or its pid reused, ValueError if the
    process it names is not one of this user's."""
    pid = entry["pid"]
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise StaleEntry(f"pid {pid} is a zombie")  # killed, not yet reaped: gone
        started, uid = proc.create_time(), proc.uids().real
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        raise StaleEntry(f"pid {pid} is gone") from None
    except psutil.AccessDenied:
        raise ValueError(f"pid {pid} cannot be inspected") from None
    if abs(started - entry["pid_started"]) >= 1.0:
        raise StaleEntry(f"pid {pid} is another process now")
    if uid != os.geteuid():
        raise ValueError(f"pid {pid} belongs to uid {uid}")


def _load(dir_fd: int, cluster_id: str) -> dict[str, Any]:
    name = f"{cluster_id}.json"
    data = _read_file(dir_fd, name)
    path = registry_dir() / name
    try:
        entry = parse_entry(data, cluster_id)
        check_process(entry)
    except ValueError as e:
        raise InvalidEntry(path, str(e), (hash(data),)) from None
    return entry


def load_entry(cluster_id: str, prune: bool = True) -> dict[str, Any] | None:
    """The checked entry of a live controller for ``cluster_id``; None if there is none (a
    stale one is deleted with ``prune``); raises InvalidEntry for one not to be trusted."""
    if not valid_id(cluster_id):
        return None
    dir_fd = _open_dir()
    if dir_fd is None:
        return None
    try:
        return _load(dir_fd, cluster_id)
    except FileNotFoundError:
        return None
    except StaleEntry:
        if prune:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{cluster_id}.json", dir_fd=dir_fd)
        return None
    finally:
        os.close(dir_fd)


_reported: set[tuple] = set()


def report(error: InvalidEntry, logger: logging.Logger | None = None) -> None:
    """One log line per untrusted file (again only if it changes), however often it is read."""
    if error.key in _reported:
        return
    if len(_reported) > 10_000:  # a flood of files must not grow this for ever
        _reported.clear()
    _reported.add(error.key)
    (logger or log).warning("monarch_nb: ignoring %s", error)


def get_entry(cluster_id: str, prune: bool = True) -> dict[str, Any] | None:
    """The live, checked entry for ``cluster_id``; a stale one is removed and None returned,
    as for an untrusted one (reported)."""
    try:
        return load_entry(cluster_id, prune)
    except InvalidEntry as e:
        report(e)
        return None


def list_entries(prune: bool = True, logger: logging.Logger | None = None) -> list[dict[str, Any]]:
    """Every live, checked entry, oldest first. Untrusted files are reported to ``logger`` and
    left alone; with ``prune``, entries of dead controllers are deleted."""
    try:
        dir_fd = _open_dir()
    except InvalidEntry as e:
        report(e, logger)
        return []
    if dir_fd is None:
        return []
    entries = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            stem, dot, ext = name.partition(".")
            if ext != "json" or not dot or not valid_id(stem):
                continue
            try:
                entries.append(_load(dir_fd, stem))
            except FileNotFoundError:
                continue  # removed since it was listed: its controller went down
            except InvalidEntry as e:
                report(e, logger)
            except StaleEntry:
                if prune:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    entries.sort(key=lambda e: e["started"])
    return entries
