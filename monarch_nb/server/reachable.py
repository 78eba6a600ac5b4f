"""Which registered clusters this Jupyter server can show, and why not the others, in one line.

An entry that passed registry.py's checks names a live controller process of this user, but
that is not enough for the sidebar to show its metrics: the process may be stopped (Ctrl-Z in
a terminal IPython, a debugger holding it), or run in another network namespace (a container
sharing this home directory), where its ``127.0.0.1`` is not this server's, or its dashboard
may not answer for some other reason. Listed anyway, such a cluster answered 410 Gone and the
sidebar waited on it. So a cluster is listed once its dashboard has answered this server; until
then it is left out with the reason the sidebar shows, and a stopped one whenever it is stopped.
One that answered once stays listed otherwise: if its scheduler dies later, the metrics route
says so and the sidebar offers to forget it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

PROBE_TIMEOUT = 3.0  # seconds a dashboard that never answered gets, each time it is probed
PROBE_AGAIN = 5.0  # seconds a probe's outcome is kept: the sidebar polls every second or so
MAX_KEPT = 10_000  # ids remembered; a flood of entries must not grow these for ever

Probe = Callable[[dict[str, Any], float], Awaitable[Any]]

_answered: set[str] = set()  # clusters whose dashboard answered this server
_probed: dict[str, tuple[float, str | None]] = {}  # id -> (when, why not) of its last probe


def answered(cluster_id: str) -> None:
    """The cluster's dashboard answered this server (the metrics route says so too)."""
    if len(_answered) > MAX_KEPT:
        _answered.clear()
    _answered.add(cluster_id)


async def split(
    entries: list[dict[str, Any]], probe: Probe
) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """(the entries to list, [(entry, why it is not listed)]), in the order given.
    ``probe(entry, timeout)`` asks the entry's dashboard for a page, raising if none comes."""
    reasons = await asyncio.gather(*(_why_not(e, probe) for e in entries))
    listed = [e for e, why in zip(entries, reasons, strict=True) if why is None]
    left_out = [(e, why) for e, why in zip(entries, reasons, strict=True) if why is not None]
    return listed, left_out


async def _why_not(entry: dict[str, Any], probe: Probe) -> str | None:
    cluster_id = entry["id"]
    why = process_reason(entry["pid"])  # a stopped process is left out until it continues
    if why is not None or cluster_id in _answered:
        return why
    now = time.monotonic()
    kept = _probed.get(cluster_id)
    if kept is not None and now - kept[0] < PROBE_AGAIN:
        return kept[1]
    if not entry["dashboard_url"]:
        why = "its scheduler runs no dashboard, where the sidebar reads a cluster's metrics"
    else:
        try:
            await probe(entry, PROBE_TIMEOUT)
        except Exception as e:  # Gone (a refused connection, a timeout) says where and why
            why = str(e) or f"its dashboard at {entry['dashboard_url']} does not answer"
    if why is None:
        answered(cluster_id)
        _probed.pop(cluster_id, None)
        return None
    if len(_probed) > MAX_KEPT:
        _probed.clear()
    _probed[cluster_id] = (time.monotonic(), why)
    return why


def process_reason(pid: int) -> str | None:
    """Why the controller process ``pid`` (alive, this user's) cannot answer this server at
    all, or None: stopped, or in another network namespace."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        status = None
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return (
            f"its process (pid {pid}) is stopped; its scheduler answers once it continues "
            f"(kill -CONT {pid})"
        )
    try:
        theirs = os.readlink(f"/proc/{pid}/ns/net")
        ours = os.readlink("/proc/self/ns/net")
    except OSError:  # not Linux, or not ours to read: nothing to tell
        return None
    if theirs != ours:
        return (
            f"its process (pid {pid}) runs in another network namespace (a container?), "
            "whose 127.0.0.1 is not this server's"
        )
    return None
