"""Fault tolerance made visible (a cluster started with ``--ft``): what the live panel draws and
what the kernel publishes for the sidebar.

The controller records, as they happen (controller/healing.py), ``ft_events`` (a rank lost,
joining, healing, back: dicts with time, rank, event, step, participants) and ``ft_steps``
(``(time, committed step, participants)`` as every rank reports them, ~10 a second each).
``feed`` turns them into one small dict, the same for every view::

    {"world": 4,
     "participants": [[0, 4], [57, 3], [71, 4], [199, 4]],  # where it changed, and the last
     "lost": [[57, 2]],                                      # [step, rank] of each loss
     "events": [{"time", "rank", "event", "step", "participants"}, ...],  # the newest
     "away": [{"rank": 2, "state": "joining", "step": None}],  # ranks out of the cell now
     "back": [{"rank": 2, "step": 71}]}                         # returned a moment ago

The live panel draws it (notebook/panel_ft.py) and ``publish`` sends it to the scheduler on
TOPIC, where the metrics store keeps the latest (store.py's ``Store.ft``, bounded by
``bounded``) and ``/monarch/metrics.json`` serves it with the ranks (dashboard.py), for the
Jupyter server's view (figures.py's ``rank_view``) and the sidebar.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TOPIC = "monarch-ft"
AWAY = ("lost", "joining", "healing")  # a rank's states while out of a fault-tolerant cell
BACK_SHOWN = 8.0  # seconds a returned rank is marked "back at step N"
MAX_CHANGES = 400  # changes of participants kept, the newest
MAX_EVENTS = 20  # events kept, the newest
MAX_RANKS = 1024  # ranks away (and back) kept


def copy(items: Iterable) -> list:
    """A list of ``items`` (a deque another thread appends to: its iterator would complain)."""
    for _ in range(20):
        try:
            return list(items)
        except RuntimeError:  # mutated while copied; the next try takes the newer one
            continue
    return []


def participants(steps: Iterable, since: float | None = None) -> list[list[int]]:
    """``[[step, participants], ...]`` in step order: the first step, each step where the
    participants changed, and the last step (a step reported several times counts as its last
    report); the newest MAX_CHANGES. ``since``: only reports from then on (a cell's own)."""
    by_step: dict[int, int] = {}
    for t, step, n in copy(steps):
        if (since is None or t >= since) and isinstance(step, int) and isinstance(n, int):
            by_step[step] = n
    ordered = sorted(by_step.items())
    out: list[list[int]] = []
    for i, (step, n) in enumerate(ordered):
        if not out or out[-1][1] != n or i == len(ordered) - 1:
            out.append([step, n])
    return out[-MAX_CHANGES:]


def last_events(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's newest event."""
    return {e["rank"]: e for e in events if isinstance(e.get("rank"), int)}


def cell_events(ctl, since: float | None = None) -> list[dict[str, Any]]:
    """A copy of the controller's events, from ``since`` on (a cell's own)."""
    return [
        dict(e)
        for e in copy(getattr(ctl, "ft_events", ()))
        if isinstance(e, Mapping) and (since is None or e.get("time", 0) >= since)
    ]


def away(
    events: list[dict[str, Any]], live: Iterable[int], now: float | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ranks of ``live`` (those still in the cell) whose newest event says they are away
    (lost, joining, healing), and those that came back within BACK_SHOWN of ``now``."""
    live = set(live)
    out, back = [], []
    for rank, e in sorted(last_events(events).items()):
        if rank not in live:
            continue
        if e["event"] in AWAY:
            out.append({"rank": rank, "state": e["event"], "step": e.get("step")})
        elif e["event"] == "back" and now is not None and now - e.get("time", 0) < BACK_SHOWN:
            back.append({"rank": rank, "step": e.get("step")})
    return out[:MAX_RANKS], back[:MAX_RANKS]


def feed(
    ctl, since: float | None = None, live: Iterable[int] = (), now: float | None = None
) -> dict[str, Any] | None:
    """The picture's data from a controller's records (None where the cluster has no ``--ft``):
    ``since`` keeps a cell's own (its start), ``live`` the ranks still in the cell (``away``)."""
    if getattr(ctl, "ft", None) is None:
        return None
    events = cell_events(ctl, since)
    out, back = away(events, live, now)
    lost = [[e["step"], e["rank"]] for e in events if e["event"] == "lost" and _int(e.get("step"))]
    return {
        "world": ctl.world_size,
        "participants": participants(getattr(ctl, "ft_steps", ()), since),
        "lost": lost[-MAX_CHANGES:],
        "events": events[-MAX_EVENTS:],
        "away": out,
        "back": back,
    }


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def bounded(msg: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the scheduler keeps of a message on TOPIC: the known fields, each of its type and
    bounded (any client may log on a topic; Dask's msgpack hands lists over as tuples); None
    for one that is not a feed."""
    world = msg.get("world")
    if not _int(world):
        return None

    def pairs(name: str) -> list[list[int]]:
        items = msg.get(name)
        items = items[-MAX_CHANGES:] if isinstance(items, list | tuple) else []
        return [
            [p[0], p[1]]
            for p in items
            if isinstance(p, list | tuple) and len(p) == 2 and _int(p[0]) and _int(p[1])
        ]

    def dicts(name: str, keys: tuple, limit: int) -> list[dict[str, Any]]:
        items = msg.get(name)
        out = []
        for item in items[-limit:] if isinstance(items, list | tuple) else []:
            if isinstance(item, Mapping) and _int(item.get("rank")):
                out.append({k: item.get(k) if check(item.get(k)) else None for k, check in keys})
        return out

    event = (
        ("time", _num),
        ("rank", _int),
        ("event", lambda v: v in (*AWAY, "back")),
        ("step", _int),
        ("participants", _int),
    )
    state = (("rank", _int), ("state", lambda v: v in AWAY), ("step", _int))
    return {
        "world": world,
        "participants": pairs("participants"),
        "lost": pairs("lost"),
        "events": [e for e in dicts("events", event, MAX_EVENTS) if e["event"]],
        "away": [a for a in dicts("away", state, MAX_RANKS) if a["state"]],
        "back": dicts("back", (("rank", _int), ("step", _int)), MAX_RANKS),
    }


# -- the kernel's side: publishing -----------------------------------------------------------
_sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> the last feed sent
_sent_lock = threading.Lock()


def publish(client, data: dict[str, Any]) -> bool:
    """Send ``data`` (a ``feed``) to ``client``'s scheduler on TOPIC, unless it is what was
    sent last; never waits (on the client's event loop, a scheduler gone is a debug line).
    Whether it was sent."""
    text = json.dumps(data, sort_keys=True, default=str)
    with _sent_lock:
        if _sent.get(client) == text:
            return False
        _sent[client] = text
    try:
        client.loop.add_callback(_send, client, data)
    except Exception:  # the client closed
        logger.debug("ft: not published", exc_info=True)
        return False
    return True


async def _send(client, data: dict[str, Any]) -> None:
    try:
        await client.scheduler.log_event(topic=TOPIC, msg=data)
    except Exception:
        logger.debug("ft: the scheduler did not take the feed", exc_info=True)
