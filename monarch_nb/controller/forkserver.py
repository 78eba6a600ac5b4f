"""Local worker processes forked from one process that has already imported what they import.

A worker process started afresh (multiprocessing's ``spawn``, Dask's default) imports Dask,
torch and the engine by itself: 4 workers on 2 cores take about 4 imports' time, twice over.
Forked from multiprocessing's forkserver, which imports them once (its preload, rank/preload.py:
with the garbage collector off, and what they made frozen) while this process starts the
scheduler, each worker starts with them already imported. Nothing in the forkserver touches a
GPU (importing torch does not), so each forked worker still picks its own
GPU, through the pinning variable its nanny sets in it.

The forkserver is started by ``%load_ext monarch_nb`` (``warm``), so that by the time the user
runs ``%monarch up`` its imports are done, or else by ``up``; either from a thread that blocks
SIGINT (session.py): the workers forked from it start with SIGINT blocked, as spawned ones do.
One that no local cluster asked for within WARM_FOR seconds is let go of (its 250 MiB back),
as is one when the extension is unloaded or the notebook joins another cluster. It is let go
of when a local cluster closes (it exits once the last process forked from it has), and started
afresh when this process's stdout or stderr is no longer what it was (workers inherit them).
``MONARCH_NB_FORKSERVER=up`` leaves it to ``up``; ``MONARCH_NB_FORKSERVER=0`` turns it off
(workers are spawned, as Dask does by default).
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import sys
import threading

PRELOAD = ["monarch_nb.rank.preload"]  # Dask, torch and the engine: rank/preload.py
METHOD_KEY = "distributed.worker.multiprocessing-method"
ENVIRON_KEY = "distributed.nanny.pre-spawn-environ"

WARM_FOR = 600.0  # seconds a forkserver that %load_ext started waits for a local cluster
DASK_HASH_SEED = "6640"  # the PYTHONHASHSEED Dask's nanny gives its workers where none is set
DASK_BOOKKEEPING = ("__DASK_PARENT_PID",)  # set by a cluster as it starts: for process titles

_lock = threading.Lock()
_claimed = False  # whether a local cluster forks its workers from the running forkserver
_inherited: tuple = ()  # fds 1 and 2 of this process and its environment when ours started


def _server():
    from multiprocessing import forkserver

    return forkserver._forkserver  # the one forkserver of this process, multiprocessing's


def enabled() -> bool:
    return (
        os.environ.get("MONARCH_NB_FORKSERVER", "1") != "0"
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


def warm() -> None:
    """Start the forkserver now, ahead of ``up``, from a thread of its own (this returns at
    once): ``%load_ext`` calls it, so that its imports run while the user writes the next cell.
    Let go of if no local cluster has asked for it within WARM_FOR seconds, or when the
    extension is unloaded or the notebook joins another cluster (``release_unclaimed``)."""
    if enabled() and os.environ.get("MONARCH_NB_FORKSERVER", "1") != "up":
        threading.Thread(target=_warm, name="monarch-forkserver-warm", daemon=True).start()


def _warm() -> None:
    from monarch_nb.rank import session

    session.block_interrupts()  # as in up's thread: the workers start with SIGINT blocked
    pid = _start(claim=False)
    if pid is not None:
        timer = threading.Timer(WARM_FOR, _release, args=(pid,))
        timer.name, timer.daemon = "monarch-forkserver-warm", True
        timer.start()


def release_unclaimed() -> None:
    """Let go of a forkserver that ``warm`` started and no local cluster has asked for."""
    _release(None)


def _release(pid: int | None) -> None:
    with _lock:
        server = _server()
        running = getattr(server, "_forkserver_pid", None)
        if _ours(server) and not _claimed and running is not None and pid in (None, running):
            _let_go(server)


def start() -> bool:
    """Start the forkserver, importing PRELOAD, unless one runs already (``warm`` may have
    started it); whether workers should be forked from it. Returns at once: the imports run
    while the scheduler starts."""
    return _start(claim=True) is not None


def _start(claim: bool) -> int | None:
    """The pid of our forkserver, started if need be; None where it is off. ``claim``: a local
    cluster forks its workers from it (a warm one unclaimed is let go of after a while)."""
    global _inherited, _claimed
    if not enabled():
        return None
    extra = _spawn_environ()
    server = _server()
    with _lock:
        running = getattr(server, "_forkserver_pid", None) is not None
        if running and _ours(server) and _inherited != _inheritance(extra):
            # A worker writes (outside cells) to the stdout and stderr it inherits, and reads
            # the environment it inherits: this process's as they are now, as a spawned
            # worker's are, not as they were when the forkserver started (pytest's capfd, a
            # redirected kernel, a variable the user set after %load_ext).
            _let_go(server)
            running = False
        if not running:
            server.set_forkserver_preload(PRELOAD)
            with _environ(extra):
                server.ensure_running()
            _inherited = _inheritance(extra)
        _claimed = _claimed or claim
        return server._forkserver_pid


def keep_preload() -> None:
    """Dask sets its own preload list (importing it here, on the event loop) the first time it
    forks a worker, unless told it has: ours stays, also for a forkserver started later. Called
    where Distributed is imported anyway: not from ``warm``'s thread, which would import it
    while the notebook's own thread may be importing it too."""
    import distributed.utils

    distributed.utils._forkserver_preload_set = True


def _spawn_environ() -> dict[str, str]:
    """What each nanny puts in this process's environment before it starts a worker (e.g.
    OMP_NUM_THREADS=1, read as torch loads), as the nanny does it: a variable already set
    stays, and string hashing is seeded alike in every worker. The forkserver needs it as it
    starts, for every worker forked from it."""
    extra = {k: str(v) for k, v in _pre_spawn_environ().items() if k not in os.environ}
    if os.environ.get("PYTHONHASHSEED") in (None, "0"):
        extra["PYTHONHASHSEED"] = DASK_HASH_SEED
    return extra


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``extra`` in this process's environment while the forkserver is started: only there,
    so that ``%load_ext`` (which starts it) leaves the notebook's own environment alone."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _pre_spawn_environ() -> dict:
    """Dask's ``distributed.nanny.pre-spawn-environ``, without importing Distributed (half a
    second, which the forkserver would wait for): its defaults reach Dask's config when it is
    imported, so until then they are read from its ``distributed.yaml``, under the user's. Where
    Dask itself is not imported yet (a fifth of a second more), Distributed's defaults alone:
    ``start_local`` asks again once it has imported Dask, which starts the forkserver afresh
    where the user's configuration changed them."""
    config = getattr(sys.modules.get("dask"), "config", None)  # an attribute once imported
    env = (config.get(ENVIRON_KEY, default=None) if config else None) or {}
    if config and any("distributed" in defaults for defaults in config.defaults):
        return env  # Distributed's defaults are in (not merely its import under way)
    spec = importlib.util.find_spec("distributed")
    if spec is None or not spec.submodule_search_locations:
        return env
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a tenth of the time
    with open(os.path.join(spec.submodule_search_locations[0], "distributed.yaml")) as f:
        defaults = yaml.load(f, Loader=loader)
    for key in ENVIRON_KEY.split("."):
        defaults = (defaults or {}).get(key)
    return {**(defaults or {}), **env}


def _ours(server) -> bool:
    """Whether the forkserver imports what this module has it import (a user's own may
    import other things, and is left alone)."""
    return list(getattr(server, "_preload_modules", None) or ()) == PRELOAD


def _inheritance(extra: dict[str, str]) -> tuple:
    """What a forkserver started now would inherit from this one: what fds 1 and 2 are
    (device and inode) and the environment, with ``extra`` (the nanny's variables, which it
    also puts in this process's environment as it starts a worker: the same either way)."""
    found = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            found.append((st.st_dev, st.st_ino))
        except OSError:
            found.append(None)
    environ = {k: v for k, v in os.environ.items() if k not in DASK_BOOKKEEPING}
    return tuple(found), {**environ, **extra}


def stop() -> None:
    """Let go of our forkserver: the next ``up`` starts a fresh one. The workers of a cluster
    still open go on; a restart of theirs starts a fresh one too."""
    with _lock:
        server = _server()
        if _ours(server):
            _let_go(server)


def _let_go(server) -> None:
    """Have multiprocessing start a new forkserver when next asked, without waiting for this
    one: it exits once every process forked from it has (each holds a copy of the pipe whose
    end it waits for), and a thread reaps it then. multiprocessing's own ``_stop`` waits, for
    as long as a worker of another cluster (or a process of the user's) lives."""
    from multiprocessing import util

    with getattr(server, "_lock", None) or contextlib.nullcontext():
        pid, alive, address = (
            getattr(server, "_forkserver_pid", None),
            getattr(server, "_forkserver_alive_fd", None),
            getattr(server, "_forkserver_address", None),
        )
        if pid is None or alive is None:
            return
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        global _claimed
        _claimed = False
        with contextlib.suppress(OSError):
            os.close(alive)
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
    threading.Thread(target=_reap, args=(pid,), name="monarch-forkserver", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)
