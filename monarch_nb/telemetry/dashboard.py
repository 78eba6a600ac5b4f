"""The scheduler's own dashboard server gets three routes:

- ``/monarch``: a bokeh page of the figures in ``figures.py``, polling ``figures.json``;
- ``/monarch/metrics.json``: the workers and ``metrics_store.metrics_snapshot`` (what the Jupyter
  server turns into the sidebar's view);
- ``/monarch/figures.json``: the same, as the columns of the page's data sources.

Two documented ways in, both with nothing but this package installed where the scheduler runs:

- ``DashboardPlugin``, a scheduler plugin that adds the routes when it starts; the controller
  registers it (``install(client)``), so it works for local clusters and for schedulers started
  elsewhere (SLURM, Kubernetes) alike;
- the module-level ``routes``, for the ``distributed.scheduler.http.routes`` configuration list
  of a scheduler started by hand::

      distributed:
        scheduler:
          http:
            routes: [distributed.http.scheduler.prometheus, ..., monarch_nb.telemetry.dashboard]
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.http.utils import RequestHandler
from tornado.web import HTTPError

logger = logging.getLogger(__name__)

PLUGIN_NAME = "monarch-dashboard"
PAGE_PATH = "/monarch"
METRICS_PATH = "/monarch/metrics.json"
FIGURES_PATH = "/monarch/figures.json"


def worker_rows(scheduler) -> list[dict[str, Any]]:
    """What the scheduler knows of each worker, whether or not telemetry is flowing."""
    rows = []
    for ws in scheduler.workers.values():
        rows.append(
            {
                "name": ws.name,
                "address": ws.address,
                "host": ws.host,
                "status": ws.status.name,
                "nthreads": ws.nthreads,
                "processing": len(ws.processing),
                "cpu": ws.metrics.get("cpu"),
                "memory": ws.metrics.get("memory"),
                "memory_limit": ws.memory_limit,
            }
        )
    return rows


def payload(
    scheduler, since: float | None = None, points: int | None = None, samples: int | None = None
) -> dict[str, Any]:
    """The JSON served at ``/monarch/metrics.json``: the workers and the metrics store
    (``metrics_store.metrics_snapshot``), with rows newer than ``since``, at most ``points`` scalar
    rows (evenly thinned) and the last ``samples`` telemetry samples per rank."""
    from monarch_nb.telemetry.store import metrics_snapshot

    snapshot = metrics_snapshot(scheduler, since, points, samples)
    return {"time": time.time(), "workers": worker_rows(scheduler), "metrics": snapshot}


class _JSONHandler(RequestHandler):
    def _number(self, name: str, kind):
        text = self.get_argument(name, None)
        if text is None:
            return None
        try:
            value = kind(text)
        except ValueError:
            raise HTTPError(400, f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise HTTPError(400, f"{name} must be a finite number >= 0, got {text!r}")
        return value

    def payload(self) -> dict[str, Any]:
        return payload(
            self.server,
            since=self._number("since", float),
            points=self._number("points", int),
            samples=self._number("samples", int),
        )

    def send(self, data: dict[str, Any]) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(finite(data), allow_nan=False, default=_jsonable))


class MetricsJSON(_JSONHandler):
    """``?since=T`` rows newer than T; ``?points=N`` at most N scalar rows per rank;
    ``?samples=N`` the last N telemetry samples per rank."""

    def get(self):
        self.send(self.payload())


class FiguresJSON(_JSONHandler):
    """The columns of the ``/monarch`` page's data sources (``figures.figure_columns``)."""

    def get(self):
        from monarch_nb.telemetry.figures import figure_columns

        self.send(figure_columns(self.payload()))


class MonarchPage(RequestHandler):
    def get(self):
        from monarch_nb.telemetry.figures import page_html

        self.set_header("Content-Type", "text/html; charset=UTF-8")
        # relative, so the page works at /monarch and behind the Jupyter server's proxy
        self.write(page_html(data_url=FIGURES_PATH.lstrip("/") + "?points=2000&samples=1"))


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: a diverged loss must not break JSON.parse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | tuple):
        return list(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


# For the ``distributed.scheduler.http.routes`` configuration (see the module docstring).
routes: list[tuple] = [
    (METRICS_PATH, MetricsJSON, {}),
    (FIGURES_PATH, FiguresJSON, {}),
    (PAGE_PATH, MonarchPage, {}),
]


def add_routes(scheduler) -> bool:
    """Add the routes to a running scheduler's HTTP server; False if they are already there."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    if getattr(app, "_monarch_routes", False):
        return False
    app.add_handlers(".*$", [(path, cls, {"dask_server": scheduler}) for path, cls, _ in routes])
    app._monarch_routes = True
    return True


class DashboardPlugin(SchedulerPlugin):
    """Adds ``/monarch`` and ``/monarch/metrics.json`` to the scheduler it is registered on."""

    name = PLUGIN_NAME
    idempotent = True  # a second controller on the same scheduler finds the routes in place

    async def start(self, scheduler) -> None:
        add_routes(scheduler)


def install(client) -> bool:
    """Register the dashboard routes on ``client``'s scheduler (idempotent). False, with a log
    line, where the scheduler cannot load the plugin (monarch_nb not installed there): the
    cluster still works, only its dashboard page and the sidebar's figures are missing."""
    try:
        client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
        return True
    except Exception as e:
        logger.warning("monarch_nb: no /monarch dashboard on the scheduler: %s", e)
        return False
