"""Local workers forked from a forkserver that imported what they import, and quiet when idle
(issue 24: start-up, idle CPU)."""

from __future__ import annotations

import os
import time

import dask
import psutil
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


def _forkservers() -> set[int]:
    """This process's forkservers (children; the workers forked from one have its command
    line too, and are its children)."""
    found = set()
    for p in psutil.Process().children():
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.Error:
            pass
    return found


def test_workers_are_forked_from_a_forkserver_that_down_stops(no_current):
    before = _forkservers()
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
    assert wait_for(lambda: _forkservers() <= before, timeout=20), _forkservers() - before
    # the notebook's own Dask config is as it was
    assert dask.config.get("distributed.worker.profile.enabled") == profile
    assert dask.config.get(forkserver.METHOD_KEY) == method


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
