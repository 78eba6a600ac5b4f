"""What Dask logs in a local worker whose output is the notebook's: nothing of its own end.

A worker the notebook started writes to the kernel's stderr (it inherits it), so what Dask
logs there reaches whatever cell runs, or ``%monarch down``'s. As a worker closes, Dask closes
its connections to the scheduler; a heartbeat still waiting for its answer then fails, and Dask
logs ``Failed to communicate with scheduler during heartbeat`` with two tracebacks. The
scheduler, in the kernel, answers late with many workers on a loaded machine (16 on 2
cores: about one down in five printed them, once per worker caught). Where the scheduler
goes first (the sidebar's "Shut down"), each worker's heartbeat fails the same way, maybe
before it hears why.

Both say what the notebook asked for, or what the controller says itself in one line (``the
scheduler is gone``). So a local worker drops Dask's records once it is closing (whatever
ends it: down, restart, scale, its scheduler's close), and its heartbeat's failures at any
time: its scheduler is in the kernel, on this machine, and fails only as it goes. Remote
workers log as Dask has them, in their own logs.
"""

from __future__ import annotations

import logging

# Worker.status names from which the worker only ends (closing_gracefully: it retires)
ENDING = frozenset({"closing", "closing_gracefully", "closed", "failed", "stopping", "stopped"})
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."


class Ending(logging.Filter):
    """Drops ``distributed``'s records once ``worker`` is ending, and its heartbeat's
    failures."""

    def __init__(self, worker):
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("distributed"):
            return True
        if record.msg == HEARTBEAT_FAILED:
            return False
        status = getattr(getattr(self.worker, "status", None), "name", "running")
        return status not in ENDING


def quiet_ending(worker) -> None:
    """Put the filter on the handlers Dask's records reach in this process (those of the
    ``distributed`` logger, and the root's where they propagate); once a process."""
    logger = logging.getLogger("distributed")
    handlers = list(logger.handlers)
    if logger.propagate:
        handlers += logging.getLogger().handlers
    for handler in handlers:
        if not any(isinstance(f, Ending) for f in handler.filters):
            handler.addFilter(Ending(worker))
