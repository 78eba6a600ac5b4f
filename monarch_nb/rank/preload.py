"""What the forkserver imports, once, for the local workers forked from it (forkserver.py).

Python's cyclic garbage collector runs over and over while a package as large as torch imports
(each thousand or so new objects starts a collection, each a tenth of those a fuller one): on
the development machine a fifth of the import. It is off while these import, and what they made
is then frozen (``gc.freeze``), as CPython's documentation advises before forking: a worker's
collections skip the objects every worker shares (a full one no longer walks torch's few hundred
thousand), and touching them no longer copies their pages into each worker. The collector is
back on before the first fork, so every worker starts with it on.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys

MODULES = (
    "distributed",
    "torch",
    "monarch_nb.rank.engine",
    # What a worker imports later, as it starts and runs its first cell (150 modules, a tenth
    # of a second in each worker, after its fork): once here instead (a test finds any more).
    "distributed.http.health",
    "distributed.http.statics",
    "distributed.http.worker.prometheus.core",
    "multiprocessing.popen_forkserver",
    "multiprocessing.synchronize",
    "IPython.core.displayhook",
    "IPython.core.formatters",
    "IPython.display",
    "comm",
    "numpy.random",
    "tornado.platform.asyncio",
    "monarch_nb.controller.dist",
    "torch.distributed.nn.functional",  # before any group: controller/dist.py's _unpin
    "monarch_nb.dispatch.reader",
    "monarch_nb.rank.remote",
    "monarch_nb.telemetry.recorder",
    "monarch_nb.telemetry.samplers",
)
LOADED: frozenset[str] = frozenset()  # the modules imported here, which each worker starts with


def _preload() -> None:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in MODULES:
            # a worker missing one imports it itself, and says what is missing
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    finally:
        global LOADED
        LOADED = frozenset(sys.modules)
        gc.freeze()
        if was_enabled:
            gc.enable()


_preload()
