"""Local workers forked from a forkserver that imported what they import, and quiet when idle
(issue 24: start-up, idle CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import dask
import distributed  # noqa: F401 (its defaults enter Dask's config)
import pytest
from _forkservers import forkservers
from _wait import wait_for

import monarch_nb
from monarch_nb.controller import cluster, forkserver


def _parent_cmdline(engine) -> str:
    import os

    import psutil

    return " ".join(psutil.Process(os.getppid()).cmdline())


def _quiet_settings(engine) -> tuple:
    import dask

    return (
        dask.config.get("distributed.worker.profile.enabled"),
        sorted(engine.worker.periodic_callbacks),
        engine.worker._tick_interval,
    )


def test_workers_are_forked_from_a_forkserver_that_down_stops(no_current):
    before = set(forkservers())
    profile = dask.config.get("distributed.worker.profile.enabled")
    method = dask.config.get(forkserver.METHOD_KEY)
    ctl = monarch_nb.up(workers=2, cpu=True, dist=False)
    try:
        parents = ctl.call(_parent_cmdline).values()
        assert all("multiprocessing.forkserver" in p for p in parents), parents
        assert all(f"'{m}'" in parents[0] for m in forkserver.PRELOAD), parents[0]
        # the statistical profiler (every 10 ms) is off, the loop's health checked each second
        enabled, callbacks, tick = ctl.call(_quiet_settings).values()[0]
        assert enabled is False and "profile" not in callbacks, callbacks
        assert tick == 1.0
        ctl.restart()  # restarted workers come from it too
        assert all("multiprocessing.forkserver" in p for p in ctl.call(_parent_cmdline).values())
    finally:
        ctl.down()
    # it exits once the last worker forked from it has
    assert wait_for(lambda: set(forkservers()) <= before, timeout=20), set(forkservers()) - before
    # the notebook's own Dask config is as it was
    assert dask.config.get("distributed.worker.profile.enabled") == profile
    assert dask.config.get(forkserver.METHOD_KEY) == method


# A cell, not a function of this module, which a worker would import (pytest and all) to run it.
_IMPORTS_SINCE_THE_FORK = """
import gc, sys
from monarch_nb.rank import preload
(sorted(set(sys.modules) - preload.LOADED), gc.isenabled(), gc.get_freeze_count())
"""


def test_a_worker_finds_what_it_imports_imported_and_frozen(no_current):
    """The forkserver imports what a worker goes on to import as it starts and runs cells, with
    the collector off, then freezes it: a worker imports nothing more, and its collector is on
    and skips the objects every worker shares. A module named here was imported by a worker
    after its fork: add it to rank/preload.py's MODULES."""
    ctl = monarch_nb.up(workers=2, cpu=True)  # fresh workers: the shared ones ran other tests
    try:
        ctl.run("x = 1\nprint(x)")
        for imported, enabled, frozen in ctl.run(_IMPORTS_SINCE_THE_FORK).values():
            assert imported == [], imported
            assert enabled
            assert frozen > 100_000, frozen  # torch alone is a few hundred thousand objects
    finally:
        ctl.down()


def test_importing_the_package_imports_neither_dask_nor_torch():
    """``import monarch_nb`` (and the forkserver's import of the engine through it) brings no
    controller, IPython, Dask or torch: each comes with the name that needs it."""
    code = (
        "import sys, monarch_nb\n"
        "heavy = ('distributed', 'dask', 'torch', 'IPython', 'monarch_nb.controller.controller')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "from monarch_nb import ValueMesh, up\n"
        "print(up.__module__, ValueMesh.__module__, 'up' in dir(monarch_nb))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "[]",
        "monarch_nb.controller.start monarch_nb.dispatch.results True",
    ], out
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        monarch_nb.nothing  # noqa: B018


def test_without_the_forkserver_workers_are_spawned(no_current, monkeypatch):
    monkeypatch.setenv("MONARCH_NB_FORKSERVER", "0")
    ctl = monarch_nb.up(workers=1, cpu=True, dist=False)
    try:
        assert ctl.call(lambda engine: os.getppid()).values() == [os.getpid()]
    finally:
        ctl.down()


def _heartbeat_ms(engine) -> float:
    return engine.worker.periodic_callbacks["heartbeat"].callback_time


def _last_seen(dask_scheduler) -> list[float]:
    return [ws.last_seen for ws in dask_scheduler.workers.values()]


def test_local_workers_heartbeat_once_a_second(clean):
    # Dask's scheduler asks for 0.5 s of a small cluster in its answer to each heartbeat
    since = time.time()
    assert wait_for(lambda: min(clean.client.run_on_scheduler(_last_seen)) > since, timeout=10)
    want = [cluster.HEARTBEAT * 1000] * clean.world_size
    assert wait_for(lambda: clean.call(_heartbeat_ms).values() == want, timeout=3)
