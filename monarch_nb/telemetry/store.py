"""The bounded stores of samples and scalars: per-rank deques of fixed length.

One ``Store`` lives in the scheduler (the ``MetricsStore`` plugin, fed by every worker's
batched ``log_event``; ``metrics_snapshot()`` reads it for the dashboard page and the
JupyterLab sidebar) and one in the controller (``metrics.MetricsHub``). Memory is bounded
whatever the logging rate: rows per rank, samples per rank, ranks and names are all capped.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from monarch_nb.telemetry import ft_feed

logger = logging.getLogger(__name__)

TOPIC = "monarch-metrics"
SCHEDULER_PLUGIN = "monarch-metrics-store"
SCALAR_ROWS = 10_000  # rows kept per rank, on the scheduler and on the controller
SAMPLE_ROWS = 1_200  # samples kept per rank: 10 minutes at 2 Hz
MAX_RANKS = 1024  # ranks (or unnamed workers) a store keeps; the least recent is forgotten
MAX_NAMES = 256  # scalar names a rank's "latest" keeps
BROKER_KEEP = 16  # batches dask's own event log keeps for TOPIC (we keep the data ourselves)


class RankStore:
    def __init__(self, key, scalar_rows: int, sample_rows: int):
        self.rank = key if isinstance(key, int) else None
        self.worker: str | None = None
        self.host: str | None = None
        self.scalars: deque = deque(maxlen=scalar_rows)
        self.samples: deque = deque(maxlen=sample_rows)
        self.values: dict[str, int | float] = {}
        self.step: int | None = None
        self.time: float | None = None
        self.sample: dict | None = None
        self.labels: dict[str, str] = {}  # mesh coordinates and label()'s: {"dp": "1"}
        self.messages = self.rows = self.dropped = 0
        self.seen = time.monotonic()
        self.rec: str | None = None  # the recorder (one per worker process) that sent the last
        self.retired = False  # its rank left the cluster (scale.py): logged rows stay, unshown

    def add(self, msg: Mapping[str, Any]) -> None:
        self.worker, self.host = msg.get("worker"), msg.get("host")
        self.rec, self.retired = msg.get("rec"), False
        if "labels" in msg:
            self.labels = msg["labels"]
        self.seen = time.monotonic()
        for step, t, values in msg.get("scalars", ()):
            self.scalars.append((step, t, values))
            self.step, self.time = step, t
            for name, value in values.items():
                if name in self.values or len(self.values) < MAX_NAMES:
                    self.values[name] = value
        samples = msg.get("samples") or ()
        self.samples.extend(samples)
        if samples:
            self.sample = samples[-1]
        self.messages += 1
        self.rows += len(msg.get("scalars", ()))
        self.dropped += int(msg.get("dropped", 0))

    def latest(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "worker": self.worker,
            "host": self.host,
            "step": self.step,
            "time": self.time,
            "values": dict(self.values),
            "sample": self.sample,
            "labels": dict(self.labels),
        }


class Store:
    """Per-rank deques of fixed length: memory is bounded whatever the logging rate."""

    def __init__(self, scalar_rows: int = SCALAR_ROWS, sample_rows: int = SAMPLE_ROWS):
        self.scalar_rows, self.sample_rows = scalar_rows, sample_rows
        self.ranks: dict[Any, RankStore] = {}
        # recorders of workers that left (a batch may still be on its way): theirs are dropped
        self._left: deque = deque(maxlen=MAX_RANKS)
        self.ft: dict[str, Any] | None = None  # the kernel's latest fault-tolerance feed

    def retire(self, ranks) -> None:
        """Ranks that left the cluster (``%monarch scale``): no longer shown, their samples
        dropped and late batches from their workers ignored; what they logged stays in
        ``history()``, and a worker that joins as the same rank carries on from it."""
        for rank in ranks:
            rs = self.ranks.get(rank)
            if rs is not None:
                rs.retired, rs.sample = True, None
                rs.samples.clear()
                if rs.rec is not None:
                    self._left.append(rs.rec)

    def add(self, msg: Mapping[str, Any]) -> None:
        if msg.get("rec") is not None and msg.get("rec") in self._left:
            return
        key = msg.get("rank")
        if key is None:
            key = f"worker {msg.get('worker')}"
        rs = self.ranks.get(key)
        if rs is None:
            if len(self.ranks) >= MAX_RANKS:
                oldest = min(self.ranks, key=lambda k: self.ranks[k].seen)
                del self.ranks[oldest]
            rs = self.ranks[key] = RankStore(key, self.scalar_rows, self.sample_rows)
        rs.add(msg)

    def resize(self, scalar_rows: int | None = None, sample_rows: int | None = None) -> None:
        """Keep this many rows (samples) per rank from now on; the newest are kept."""
        self.scalar_rows = scalar_rows or self.scalar_rows
        self.sample_rows = sample_rows or self.sample_rows
        for rs in self.ranks.values():
            rs.scalars = deque(rs.scalars, maxlen=self.scalar_rows)
            rs.samples = deque(rs.samples, maxlen=self.sample_rows)

    def sorted(self, retired: bool = False) -> list[RankStore]:
        """The ranks in order; ``retired``: those that left the cluster too."""
        kept = [rs for rs in self.ranks.values() if retired or not rs.retired]
        return sorted(kept, key=lambda rs: (rs.rank is None, rs.rank or 0))

    def snapshot(
        self,
        since: float | None = None,
        points: int | None = None,
        samples: int | None = None,
        rows_since: float | None = None,
    ) -> dict[str, Any]:
        """JSON-serializable: every rank's latest values and rows (newer than ``since``; at
        most ``points`` scalar rows, evenly thinned, and the last ``samples`` samples).
        Non-finite floats (a diverged loss) become None, as JSON has no NaN. ``rows_since``:
        only the scalar rows logged from then on, and the latest values and step among them
        (a cell's own, for its panel), the samples as they are."""
        ranks = []
        for rs in self.sorted():
            rows = [r for r in rs.scalars if since is None or r[1] > since]
            if rows_since is not None:
                rows = _from(rows, rows_since)
            kept = [x for x in rs.samples if since is None or x["time"] > since]
            if samples is not None:
                kept = kept[-samples:] if samples > 0 else []
            scalars = [[s, t, _finite(v)] for s, t, v in thin(rows, points)]
            samples_out = [_finite(x) for x in kept]
            entry = rs.latest()
            if rows_since is not None:
                values: dict[str, Any] = {}
                for _, _, v in rows:
                    values.update(v)
                last = rows[-1] if rows else (None, None)
                entry.update(step=last[0], time=last[1], values=values)
            entry.update(
                values=_finite(entry["values"]),
                sample=_finite(entry["sample"]) if entry["sample"] else None,
                scalars=scalars,
                samples=samples_out,
                messages=rs.messages,
                rows=rs.rows if rows_since is None else len(rows),
                dropped=rs.dropped,
            )
            ranks.append(entry)
        out = {
            "time": time.time(),
            "limits": {"scalar_rows": self.scalar_rows, "sample_rows": self.sample_rows},
            "ranks": ranks,
        }
        if self.ft is not None:  # a cluster started with --ft (ft_feed.py)
            out["ft"] = self.ft
        return out


def _from(rows: list, t: float) -> list:
    """The rows logged at ``t`` or later: the newest ones, as a rank logs them in order."""
    start = len(rows)
    while start and rows[start - 1][1] >= t:
        start -= 1
    return rows[start:]


def thin(rows: list, keep: int | None) -> list:
    """At most ``keep`` rows, evenly spaced, always with the newest."""
    if keep is None or len(rows) <= keep:
        return rows
    if keep <= 1:
        return rows[-1:]
    stride = (len(rows) - 1) / (keep - 1)
    return [rows[round(i * stride)] for i in range(keep)]


def _finite(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


class MetricsStore(SchedulerPlugin):
    """The scheduler's bounded store of every rank's batches."""

    name = SCHEDULER_PLUGIN
    idempotent = True  # a second controller on the same scheduler keeps the store as it is

    def __init__(self, scalar_rows: int = SCALAR_ROWS, sample_rows: int = SAMPLE_ROWS):
        self.store = Store(scalar_rows, sample_rows)

    def start(self, scheduler) -> None:
        # dask also keeps the last `low-level-log-length` (1000) events of every topic; our
        # batches can be large, so keep only a few there: the data lives in self.store.
        for name in (TOPIC, ft_feed.TOPIC):
            try:
                topic = scheduler._broker._topics[name]
                topic.events = deque(topic.events, maxlen=BROKER_KEEP)
            except (AttributeError, KeyError, TypeError):
                logger.info("metrics: cannot shorten dask's event log for %s", name)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC and isinstance(msg, Mapping):
            self.store.add(msg)
        elif topic == ft_feed.TOPIC and isinstance(msg, Mapping):
            self.store.ft = ft_feed.bounded(msg) or self.store.ft


def metrics_snapshot(
    scheduler, since: float | None = None, points: int | None = None, samples: int | None = None
) -> dict[str, Any]:
    """The scheduler's store as JSON-serializable data (``ranks`` is empty where metrics are
    not installed); ``since``, ``points``, ``samples`` as for ``Store.snapshot``."""
    plugin = scheduler.plugins.get(SCHEDULER_PLUGIN)
    if plugin is None:
        return {"time": time.time(), "limits": {}, "ranks": []}
    return plugin.store.snapshot(since, points, samples)


def _snapshot_on_scheduler(since=None, dask_scheduler=None):
    return metrics_snapshot(dask_scheduler, since)


def _retire_on_scheduler(ranks, dask_scheduler=None):
    plugin = dask_scheduler.plugins.get(SCHEDULER_PLUGIN)
    if plugin is not None:
        plugin.store.retire(ranks)


def _resize_on_scheduler(scalar_rows, sample_rows, dask_scheduler=None):
    plugin = dask_scheduler.plugins.get(SCHEDULER_PLUGIN)
    if plugin is not None:
        plugin.store.resize(scalar_rows, sample_rows)
