"""The controller's side of the metrics: ``install(client)``, the MetricsHub and ``history()``.

The path of a number, and what bounds it at each hop::

    log() / sampler thread  -> Recorder (per worker, recorder.py): rows decimated to
        MAX_ROWS_PER_FLUSH -> worker.log_event(TOPIC, batch) every FLUSH_INTERVAL s
        (never one message per scalar)
        -> scheduler: MetricsStore plugin (store.py), deques of fixed length per rank
        -> controller: MetricsHub (client.subscribe_topic), the same bounded store;
           history(), latest(), subscribe(callback), format_latest() for %monarch metrics

``install(client)`` wires all of it; worker plugins are re-applied by the scheduler to every
worker that joins, so telemetry keeps flowing after a restart or a replaced worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from monarch_nb import errors
from monarch_nb.telemetry import samplers as telemetry
from monarch_nb.telemetry.recorder import (
    FLUSH_INTERVAL,
    WORKER_PLUGIN,
    MetricsWorkerPlugin,
    flush_now,
)
from monarch_nb.telemetry.store import (
    SAMPLE_ROWS,
    SCALAR_ROWS,
    SCHEDULER_PLUGIN,
    TOPIC,
    MetricsStore,
    Store,
    _resize_on_scheduler,
    _retire_on_scheduler,
    _snapshot_on_scheduler,
)

logger = logging.getLogger(__name__)

CATCH_UP = 5.0  # s: the most history() waits for what the ranks logged before it
RUN_WAIT = 10.0  # s: the most catch_up waits for the workers to take its request


class Row(NamedTuple):
    step: int
    time: float
    values: dict[str, int | float]


class History(Mapping):
    """What each rank logged: ``history[rank]`` is a list of Row(step, time, values)."""

    def __init__(self, rows: dict[Any, list[Row]]):
        self._rows = rows

    def __getitem__(self, rank) -> list[Row]:
        return self._rows[rank]

    def __iter__(self) -> Iterator:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def names(self) -> list[str]:
        return sorted({n for rows in self._rows.values() for r in rows for n in r.values})

    def series(self, name: str) -> dict[Any, tuple[list[int], list[float]]]:
        """rank -> (steps, values) of one scalar, for plotting."""
        out = {}
        for rank, rows in self._rows.items():
            pts = [(r.step, r.values[name]) for r in rows if name in r.values]
            if pts:
                out[rank] = ([s for s, _ in pts], [v for _, v in pts])
        return out

    def to_pandas(self):
        """One row per log() call: columns rank, step, time and one per scalar name."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("History.to_pandas() needs pandas: pip install pandas") from None
        records = [
            {"rank": rank, "step": r.step, "time": r.time, **r.values}
            for rank, rows in self._rows.items()
            for r in rows
        ]
        return pd.DataFrame(records, columns=["rank", "step", "time", *self.names()])

    def __repr__(self) -> str:
        n = sum(len(rows) for rows in self._rows.values())
        if not n:
            return "<History: nothing logged yet (log(step=..., loss=...) in a cell logs)>"
        return f"<History: {len(self._rows)} ranks, {n} rows; {', '.join(self.names())}>"


class MetricsHub:
    """The controller's view: subscribed to the workers' batches, with its own bounded store.

    ``subscribe(callback)`` calls ``callback(batch)`` for every batch on the client's event-loop
    thread (keep it quick; hand work to another thread). A batch is a dict: rank, worker, host,
    ``scalars`` (a list of [step, time, {name: value}]), ``samples`` (telemetry Samples) and
    ``dropped`` (rows thinned out on the worker).
    """

    def __init__(self, client, scalar_rows: int = SCALAR_ROWS, sample_rows: int = SAMPLE_ROWS):
        self.client = client
        self.store = Store(scalar_rows, sample_rows)
        self.closed = False
        self.scheduler_store = True
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._received: dict[str, int] = {}  # recorder token -> the last message number received
        self._callbacks: list[Callable[[dict], None]] = []
        client.subscribe_topic(TOPIC, self._on_event)

    def _on_event(self, event) -> None:
        _, msg = event
        if not isinstance(msg, Mapping):
            return
        with self._lock:
            self.store.add(msg)
            rec = str(msg.get("rec"))
            self._received[rec] = max(self._received.get(rec, 0), msg.get("seq", 0))
            self._arrived.notify_all()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(msg)
            except Exception:
                logger.exception("metrics: a subscriber failed")

    def catch_up(self, timeout: float = CATCH_UP, workers: list[str] | None = None) -> None:
        """Have every worker send what its ranks logged so far, and wait (at most ``timeout``)
        until it is here: a history read right after a cell then holds everything the cell
        logged, where the periodic flush would leave up to FLUSH_INTERVAL of it on the way.
        Skipped without a live cluster, and on the client's own event loop (a subscriber's
        callback), which must not wait for itself. Another thread's loop is fine: ipykernel 7
        runs every cell inside the asyncio loop of the kernel's main thread. ``workers``
        (addresses) limits it to those."""
        if self.closed or self.client.status != "running":
            return
        try:
            if asyncio.get_running_loop() is self.client.loop.asyncio_loop:
                return
        except RuntimeError:
            pass
        try:
            # Bounded (a stopped worker takes the message and never answers), but not by
            # ``timeout``: the first run on fresh workers can take seconds on a loaded machine,
            # and what it sends is what the caller waits for. ``workers`` leaves out silent ones.
            sent = self.client.run(
                flush_now, workers=workers, on_error="return", callback_timeout=RUN_WAIT
            )
        except Exception:
            return
        wanted = [v for v in sent.values() if isinstance(v, tuple)]
        deadline = time.monotonic() + timeout
        with self._arrived:
            while any(self._received.get(token, 0) < n for token, n in wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._arrived.wait(left)

    def history(self, ranks=None) -> History:
        """What the ranks logged, everything logged before this call included (catch_up)."""
        self.catch_up()
        with self._lock:
            rows = {
                rs.rank if rs.rank is not None else rs.worker: [Row(*r) for r in rs.scalars]
                for rs in self.store.sorted(retired=True)
                if rs.scalars and (ranks is None or rs.rank in ranks)
            }
        return History(rows)

    def latest(self) -> dict[Any, dict[str, Any]]:
        """rank -> {rank, worker, host, step, time, values, sample}."""
        with self._lock:
            return {
                rs.rank if rs.rank is not None else rs.worker: rs.latest()
                for rs in self.store.sorted()
            }

    def snapshot(
        self, points: int | None = None, samples: int | None = None, rows_since: float | None = None
    ) -> dict[str, Any]:
        """``Store.snapshot`` of this store, read under the lock its batches are added with."""
        with self._lock:
            return self.store.snapshot(points=points, samples=samples, rows_since=rows_since)

    def samples(self, rank) -> list[telemetry.Sample]:
        with self._lock:
            rs = self.store.ranks.get(rank)
            return list(rs.samples) if rs is not None else []

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` for every batch from now on; returns the unsubscribe."""
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def scheduler_snapshot(self, since: float | None = None) -> dict[str, Any]:
        """The scheduler's store (what the dashboard serves)."""
        return self.client.run_on_scheduler(_snapshot_on_scheduler, since)

    def retire(self, ranks: list[int]) -> None:
        """Ranks that left the cluster: gone from the panel, the sidebar and ``latest()``,
        kept in ``history()`` (``Store.retire``), here and on the scheduler."""
        with self._lock:
            self.store.retire(ranks)
        if self.scheduler_store:
            self.client.run_on_scheduler(_retire_on_scheduler, ranks)

    def set_limits(self, scalar_rows: int | None = None, sample_rows: int | None = None) -> None:
        """Rows and samples kept per rank, here and on the scheduler."""
        for n in (scalar_rows, sample_rows):
            if n is not None and n < 1:
                raise ValueError(f"limits must be at least 1, got {n}")
        with self._lock:
            self.store.resize(scalar_rows, sample_rows)
        if self.scheduler_store:
            self.client.run_on_scheduler(_resize_on_scheduler, scalar_rows, sample_rows)

    def close(self) -> None:
        """Stop listening; what was received stays readable."""
        if self.closed:
            return
        self.closed = True
        try:
            self.client.unsubscribe_topic(TOPIC)
        except Exception:
            logger.debug("metrics: unsubscribe failed", exc_info=True)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "live"
        return f"<MetricsHub {state}: {len(self.store.ranks)} ranks>"


_last_hub: MetricsHub | None = None
_hubs: weakref.WeakValueDictionary[str, MetricsHub] = weakref.WeakValueDictionary()


def install(
    client,
    hz: float | None = None,
    scalar_rows: int = SCALAR_ROWS,
    sample_rows: int = SAMPLE_ROWS,
    flush_interval: float = FLUSH_INTERVAL,
) -> MetricsHub:
    """Telemetry and log() for every worker of ``client``'s cluster, the scheduler's store,
    and the controller's hub. ``hz``: sampling rate (default ``$MONARCH_NB_TELEMETRY_HZ`` on
    the worker, else 2; 0 turns sampling off). A client has one hub: installing again returns
    it, with the workers' sampling set up anew."""
    global _last_hub
    if hz is not None:
        telemetry.resolve_hz(hz)  # a bad rate fails here, not on every worker
    hub = _hubs.get(client.id)
    if hub is not None and not hub.closed:
        client.register_plugin(MetricsWorkerPlugin(hz, flush_interval), name=WORKER_PLUGIN)
        return hub
    hub = _hubs[client.id] = MetricsHub(client, scalar_rows, sample_rows)
    try:
        client.register_plugin(MetricsStore(scalar_rows, sample_rows), name=SCHEDULER_PLUGIN)
    except Exception as e:  # e.g. monarch_nb is not importable where the scheduler runs
        hub.scheduler_store = False
        logger.warning("metrics: no store on the scheduler (%s); the notebook still gets them", e)
    client.register_plugin(MetricsWorkerPlugin(hz, flush_interval), name=WORKER_PLUGIN)
    _last_hub = hub
    return hub


def _hub() -> MetricsHub | None:
    ctl = errors.current()
    hub = getattr(ctl, "metrics", None)
    return hub if isinstance(hub, MetricsHub) else _last_hub


def history(ranks=None) -> History:
    """On the controller: what the ranks logged, as ``{rank: [Row(step, time, values)]}``
    (the current cluster's, or the last one's after ``%monarch down``)."""
    hub = _hub()
    return hub.history(ranks) if hub is not None else History({})


def latest() -> dict[Any, dict[str, Any]]:
    hub = _hub()
    return hub.latest() if hub is not None else {}


# -- the %monarch metrics table ---------------------------------------------------------------
def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}G"


def format_latest(entries: Mapping[Any, Mapping[str, Any]] | None = None) -> str:
    """The latest values per rank and their latest telemetry (``MetricsHub.latest()``; by
    default the current cluster's), as a text table."""
    entries = latest() if entries is None else entries
    if not entries:
        return "no metrics yet: call monarch_nb.log(step=..., name=value) in a %%monarch cell"
    names = sorted({n for entry in entries.values() for n in entry.get("values", {})})
    head = ["rank", "host", "step", *names, "device", "util", "mem", "power", "temp", "cpu"]
    table = [head]
    for rank, entry in entries.items():
        s = entry.get("sample") or {}
        values = entry.get("values", {})
        mem = "-"
        if s.get("mem_used") is not None:
            mem = f"{_bytes(s['mem_used'])}/{_bytes(s.get('mem_total'))}"
        table.append(
            [
                str(rank),
                str(entry.get("host") or "-"),
                _num(entry.get("step")),
                *(_num(values.get(n)) for n in names),
                f"{s.get('kind', '-')}: {s['device']}" if s.get("device") else "-",
                "-" if s.get("util") is None else f"{s['util']:.0f}%",
                mem,
                "-" if s.get("power") is None else f"{s['power']:.0f}W",
                "-" if s.get("temp") is None else f"{s['temp']:.0f}C",
                "-" if s.get("cpu") is None else f"{s['cpu']:.0f}%",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )
