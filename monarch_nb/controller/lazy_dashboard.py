"""Dask's own dashboard (its Bokeh pages: ``/status``, ``/workers``...) on a local cluster's
scheduler, made when it is first asked for rather than as the scheduler starts.

Importing Bokeh and Dask's dashboard is half a second, which ``up`` of 2 workers spent on a page
nobody may open: ``%monarch up`` after ``%load_ext`` took 0.47-0.60 s with it and 0.15-0.18 s
without (docs/measurements.md). The scheduler starts with its HTTP server, Dask's plain routes
(health, Prometheus, its JSON API) and ours (``/monarch``, telemetry/dashboard.py), but no Bokeh;
the first request that none of those routes takes makes the dashboard there and then (on the
scheduler's event loop, which stalls for that half second once) and is answered by it.
"""

from __future__ import annotations

import logging

from tornado import web

logger = logging.getLogger(__name__)


class LazyDashboard(web.Application):
    """A sub-application of the scheduler's ``RoutingApplication``, asked for a handler only
    when the scheduler's own routes have none: the first time, it connects Dask's dashboard,
    which goes after it in the list, and hands the request to it; from then on it takes nothing
    and the dashboard is asked directly."""

    def __init__(self, scheduler, prefix: str):
        super().__init__()
        self.scheduler = scheduler
        self.prefix = prefix
        self.made = False

    def find_handler(self, request, **kwargs):
        if self.made:
            return None
        self.made = True
        import distributed.dashboard.scheduler as dashboard

        app = self.scheduler.http_application
        dashboard.connect(app, self.scheduler.http_server, self.scheduler, prefix=self.prefix)
        logger.debug("monarch_nb: Dask's dashboard made, first asked for %s", request.path)
        return app.find_handler(request, **kwargs)  # the dashboard's, after this (made) one


def install(scheduler, prefix: str = "/") -> None:
    """Put the lazy dashboard on ``scheduler``'s HTTP server (started without Dask's)."""
    app = getattr(scheduler, "http_application", None)
    if app is not None:
        app.add_application(LazyDashboard(scheduler, prefix))
