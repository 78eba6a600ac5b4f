"""``monarch_nb.log(step=..., loss=...)`` on workers, the bounded stores of samples and scalars.

The path of a number, and what bounds it at each hop::

    log() / sampler thread  -> Recorder (per worker): rows decimated to MAX_ROWS_PER_FLUSH
        -> worker.log_event(TOPIC, batch) every FLUSH_INTERVAL s (never one message per scalar)
        -> scheduler: MetricsStore plugin, deques of fixed length per rank; metrics_snapshot()
        -> controller: MetricsHub (client.subscribe_topic), the same bounded store;
           history(), latest(), subscribe(callback), format_latest() for %monarch metrics

The stores themselves live in ``metrics_store.py``. ``install(client)`` wires all of it;
worker plugins are re-applied by the scheduler to every worker that joins, so telemetry
keeps flowing after a restart or a replaced worker.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import operator
import socket
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from distributed.diagnostics.plugin import WorkerPlugin

from monarch_nb import errors
from monarch_nb.telemetry import samplers as telemetry
from monarch_nb.telemetry.store import (
    SAMPLE_ROWS,
    SCALAR_ROWS,
    SCHEDULER_PLUGIN,
    TOPIC,
    MetricsStore,
    Store,
    _resize_on_scheduler,
    _snapshot_on_scheduler,
)

logger = logging.getLogger(__name__)

WORKER_PLUGIN = "monarch-metrics"
EXTENSION = "monarch-metrics"
FLUSH_INTERVAL = 0.5  # s: each rank sends at most 1 / FLUSH_INTERVAL messages a second
CATCH_UP = 5.0  # s: the most history() waits for what the ranks logged before it
RUN_WAIT = 10.0  # s: the most catch_up waits for the workers to take its request
MAX_ROWS_PER_FLUSH = 1024  # log() rows a worker keeps between flushes; beyond: evenly thinned
SAMPLES_PER_FLUSH = 64  # telemetry samples kept between flushes (many only if flushes stall)


# -- worker side: log() -----------------------------------------------------------------------
def _scalar(key: str, value: Any) -> int | float:
    """``value`` as a plain int or float, or a one-line TypeError naming ``key``."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, numbers.Real):  # numpy scalars, Fraction, Decimal-like
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    what = type(value).__name__
    item = getattr(value, "item", None)
    if callable(item):  # a tensor or an array: fine when it holds exactly one number
        numel = getattr(value, "numel", None)
        count = numel() if callable(numel) else getattr(value, "size", None)
        if count == 1:
            return _scalar(key, item())
        if isinstance(count, int):
            shape = tuple(getattr(value, "shape", ()))
            raise TypeError(
                f"log(): {key} must be a number or a one-element tensor, "
                f"got a {what} of shape {shape}"
            )
    raise TypeError(f"log(): {key} must be a number, got {what} {value!r:.40}")


_warned_outside = False
_recorders: list[Recorder] = []  # live recorders in this process (one per worker)


def log(step: int | None = None, **scalars: Any) -> None:
    """Record numeric scalars for this rank, e.g. ``log(step=i, loss=loss, lr=lr)``.

    Values are numbers or one-element tensors/arrays; ``step`` defaults to the rank's previous
    step + 1 (from 0). Outside a monarch worker this warns once and does nothing.
    """
    global _warned_outside
    rec = _recorder()
    if rec is None:
        if not _warned_outside:
            _warned_outside = True
            warnings.warn(
                "monarch_nb.log() called outside a cluster worker; nothing is recorded "
                "(run it in a %%monarch cell or an actor)",
                UserWarning,
                stacklevel=2,
            )
        return
    if step is not None:
        try:
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)
        except TypeError:
            raise TypeError(
                f"log(): step must be an integer or None, got {type(step).__name__} {step!r:.40}"
            ) from None
    values = {key: _scalar(key, value) for key, value in scalars.items()}
    if values:
        rec.log(step, values)


def _recorder() -> Recorder | None:
    try:
        from distributed import get_worker

        rec = get_worker().extensions.get(EXTENSION)
        if rec is not None:
            return rec
    except ValueError:
        pass
    # A cell runs in the engine's own thread, where get_worker() does not answer. The main
    # thread is the notebook's (or a script's) even where workers share its process.
    if threading.current_thread() is threading.main_thread():
        return None
    live = list(_recorders)
    if len(live) == 1:
        return live[0]
    me = threading.get_ident()
    for rec in live:  # several workers in one process: the one whose engine thread this is
        engine = rec.worker.extensions.get("monarch")
        if getattr(getattr(engine, "_thread", None), "ident", None) == me:
            return rec
    return None


class Recorder:
    """One worker's buffer of log() rows and telemetry samples, its sampler thread, and the
    flush that sends them as one event on the worker's event loop."""

    def __init__(self, worker, hz: float, flush_interval: float, max_rows: int):
        self.worker = worker
        self.host = socket.gethostname()
        self.hz = hz
        self.flush_interval = flush_interval
        self.max_rows = max_rows
        self.sent = 0  # messages, numbered 1, 2, ... in each (``seq``): the hub waits on them
        self.token = uuid.uuid4().hex  # which recorder numbered them (a restart starts anew)
        self._lock = threading.Lock()
        self._rows: list[tuple[int, float, dict]] = []
        self._samples: deque = deque(maxlen=SAMPLES_PER_FLUSH)
        self._tail: tuple | None = None  # the newest row when thinning skipped it
        self._count = 0
        self._stride = 1
        self._dropped = 0
        self._next_step = 0
        self._monitor: telemetry.Monitor | None = None
        self._monitor_key: tuple | None = None
        self._callback = None
        self.sampler = telemetry.Sampler(self._read, self._add_sample, hz)
        self.closed = False

    def start(self) -> None:
        """On the worker's event loop (a plugin's setup runs there)."""
        from tornado.ioloop import PeriodicCallback

        self._callback = PeriodicCallback(self.flush, self.flush_interval * 1000)
        self._callback.start()
        self.sampler.start()
        _recorders.append(self)

    def identity(self) -> tuple[int | None, dict | None] | None:
        """(rank, device info) once known; None while the engine waits for its controller."""
        engine = self.worker.extensions.get("monarch")
        if engine is not None:
            if not engine.identity:
                return None
            return engine.identity.get("rank"), engine.device_info or None
        name = self.worker.name
        return (name if isinstance(name, int) else None), None

    # sampler thread
    def _read(self) -> telemetry.Sample | None:
        ident = self.identity()
        if ident is None:
            return None
        rank, device = ident
        key = (device or {}).get("kind"), (device or {}).get("torch")
        if self._monitor is None or key != self._monitor_key:
            if self._monitor is not None:
                self._monitor.close()
            self._monitor, self._monitor_key = telemetry.Monitor(device), key
        return self._monitor.read(rank)

    def _add_sample(self, sample: telemetry.Sample | None) -> None:
        if sample is not None:
            with self._lock:
                self._samples.append(sample)

    # any thread
    def log(self, step: int | None, values: dict[str, int | float]) -> None:
        now = time.time()
        with self._lock:
            if step is None:
                step = self._next_step
            self._next_step = step + 1
            row = (step, now, values)
            self._count += 1
            if self._count % self._stride:
                self._tail, self._dropped = row, self._dropped + 1
                return
            self._tail = None
            self._rows.append(row)
            if len(self._rows) >= self.max_rows:
                # Too fast to send everything: keep every other row (the newer of each pair) and
                # from now on every 2nd, 4th, ... call, so the kept rows span the whole interval.
                kept = self._rows[1::2]
                self._dropped += len(self._rows) - len(kept)
                self._rows, self._stride = kept, self._stride * 2

    def drain(self) -> dict[str, Any] | None:
        ident = self.identity()
        if ident is None:
            return None
        with self._lock:
            rows, samples, dropped = self._rows, list(self._samples), self._dropped
            if self._tail is not None:
                rows.append(self._tail)
                dropped -= 1
            if not rows and not samples:
                return None
            self._rows, self._tail, self._count, self._stride, self._dropped = [], None, 0, 1, 0
            self._samples.clear()
        return {
            "rank": ident[0],
            "worker": str(self.worker.name),
            "host": self.host,
            "scalars": rows,
            "samples": samples,
            "dropped": dropped,
        }

    # event loop
    def flush(self) -> None:
        msg = self.drain()
        if msg is not None:
            try:
                self.worker.log_event(TOPIC, {**msg, "rec": self.token, "seq": self.sent + 1})
                self.sent += 1
            except Exception:
                logger.exception("metrics: could not send a batch to the scheduler")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._callback is not None:
            self._callback.stop()
        self.sampler.stop()
        if self in _recorders:
            _recorders.remove(self)
        self.flush()
        if self._monitor is not None:
            self._monitor.close()


def _flush_now(dask_worker) -> tuple[str, int] | None:
    """Run by ``client.run`` on a worker's event loop: send what is buffered now; returns
    (its recorder's token, messages sent so far), what the hub waits to have received."""
    rec = dask_worker.extensions.get(EXTENSION)
    if rec is None or rec.closed:
        return None
    rec.flush()
    return rec.token, rec.sent


class MetricsWorkerPlugin(WorkerPlugin):
    """Gives each worker a Recorder (its sampler thread and log() batching)."""

    name = WORKER_PLUGIN

    def __init__(
        self,
        hz: float | None = None,
        flush_interval: float = FLUSH_INTERVAL,
        max_rows: int = MAX_ROWS_PER_FLUSH,
    ):
        self.hz, self.flush_interval, self.max_rows = hz, flush_interval, max_rows

    def setup(self, worker) -> None:
        old = worker.extensions.pop(EXTENSION, None)
        if old is not None:
            old.close()
        # The rate is resolved on the worker, so MONARCH_NB_TELEMETRY_HZ in its environment counts.
        hz = telemetry.resolve_hz(self.hz)
        rec = Recorder(worker, hz, self.flush_interval, self.max_rows)
        worker.extensions[EXTENSION] = rec
        rec.start()

    def teardown(self, worker) -> None:
        rec = worker.extensions.pop(EXTENSION, None)
        if rec is not None:
            rec.close()


# -- controller side --------------------------------------------------------------------------
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
                _flush_now, workers=workers, on_error="return", callback_timeout=RUN_WAIT
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
                for rs in self.store.sorted()
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

    def snapshot(self, points: int | None = None, samples: int | None = None) -> dict[str, Any]:
        """``Store.snapshot`` of this store, read under the lock its batches are added with."""
        with self._lock:
            return self.store.snapshot(points=points, samples=samples)

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
