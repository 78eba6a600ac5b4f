"""``monarch_nb.log(step=..., loss=...)`` on a worker: its checks, and the Recorder that batches
log() rows and the sampler's readings into one event per FLUSH_INTERVAL. The first row or
reading after a flush asks for the next one, FLUSH_INTERVAL later: an idle worker's event loop
is not woken for flushes with nothing to send.

Rows beyond MAX_ROWS_PER_FLUSH between two flushes are thinned evenly (``dropped`` counts them),
so a tight loop of log() calls costs a bounded buffer and a bounded message rate. The
controller's side (``install``, ``history()``) is ``metrics.py``; the stores are ``store.py``.
"""

from __future__ import annotations

import logging
import numbers
import operator
import socket
import threading
import time
import uuid
import warnings
from collections import deque
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from monarch_nb.telemetry import samplers as telemetry
from monarch_nb.telemetry.store import TOPIC

logger = logging.getLogger(__name__)

WORKER_PLUGIN = "monarch-metrics"
EXTENSION = "monarch-metrics"
FLUSH_INTERVAL = 0.5  # s: each rank sends at most 1 / FLUSH_INTERVAL messages a second
MAX_ROWS_PER_FLUSH = 1024  # log() rows a worker keeps between flushes; beyond: evenly thinned
SAMPLES_PER_FLUSH = 64  # telemetry samples kept between flushes (many only if flushes stall)
# Of one core, since the sampler last asked: above it the rank counts as busy (an actor's call,
# a thread a cell left running). An idle worker uses well under 1%; any real work, far more.
BUSY_CPU = 0.05


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
        self._loop = None  # the worker's event loop, once started
        self._flush_asked = False
        self._labels_sent: dict[str, str] = {}
        self._cpu = (time.process_time(), time.monotonic())
        self._device_busy = False  # the device was in use at the last reading
        self.sampler = telemetry.Sampler(self._read, self._add_sample, hz, busy=self._busy)
        self.closed = False

    def start(self) -> None:
        """On the worker's event loop (a plugin's setup runs there)."""
        self._loop = self.worker.loop
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
            self._device_busy = bool(sample.get("util"))
            with self._lock:
                self._samples.append(sample)
                self._ask_flush()

    def _busy(self) -> bool:
        """Whether the rank works now, so that the sampler reads at its full rate: a cell or a
        call in the rank's thread, log() rows waiting, the device in use at the last reading,
        or this process above BUSY_CPU since the last ask."""
        cpu, now = time.process_time(), time.monotonic()
        then_cpu, then = self._cpu
        self._cpu = (cpu, now)
        engine = self.worker.extensions.get("monarch")
        return (
            getattr(engine, "busy", False)  # a request in the rank's thread
            or bool(self._rows)
            or self._tail is not None
            or self._device_busy
            or cpu - then_cpu > BUSY_CPU * (now - then)
        )

    # any thread
    def log(self, step: int | None, values: dict[str, int | float]) -> None:
        now = time.time()
        with self._lock:
            self._ask_flush()
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
        engine = self.worker.extensions.get("monarch")
        labels = dict(getattr(engine, "labels", None) or {})  # mesh coordinates, label()'s
        with self._lock:
            rows, samples, dropped = self._rows, list(self._samples), self._dropped
            if self._tail is not None:
                rows.append(self._tail)
                dropped -= 1
            if not rows and not samples and labels == self._labels_sent:
                return None
            self._labels_sent = labels
            self._rows, self._tail, self._count, self._stride, self._dropped = [], None, 0, 1, 0
            self._samples.clear()
        return {
            "rank": ident[0],
            "worker": str(self.worker.name),
            "host": self.host,
            "scalars": rows,
            "samples": samples,
            "dropped": dropped,
            "labels": labels,
        }

    def _ask_flush(self) -> None:
        """A flush FLUSH_INTERVAL from now, unless one is asked for already (under the lock)."""
        if self._flush_asked or self._loop is None:
            return
        self._flush_asked = True
        # thread-safe; dropped once the loop has closed
        self._loop.add_callback(self._loop.call_later, self.flush_interval, self._asked_flush)

    # event loop
    def _asked_flush(self) -> None:
        with self._lock:
            self._flush_asked = False
        if not self.closed:
            self.flush()

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
        self.sampler.stop()
        if self in _recorders:
            _recorders.remove(self)
        self.flush()
        if self._monitor is not None:
            self._monitor.close()


def flush_now(dask_worker) -> tuple[str, int] | None:
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
