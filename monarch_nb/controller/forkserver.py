"""Local worker processes forked from one process that has already imported what they import.

A worker process started afresh (multiprocessing's ``spawn``, Dask's default) imports Dask,
torch and the engine by itself: 4 workers on 2 cores take about 4 imports' time, twice over.
Forked from multiprocessing's forkserver, which imports them once (its preload) while this
process starts the scheduler, each worker starts with them already imported. Nothing in the
forkserver touches a GPU (importing torch does not), so each forked worker still picks its own
GPU, through the pinning variable its nanny sets in it.

The forkserver is started from ``up``'s thread, which blocks SIGINT (session.py): the workers
forked from it start with SIGINT blocked, as spawned ones do. It is let go of when a local
cluster closes (it exits once the last process forked from it has), and started afresh when
this process's stdout or stderr is no longer what it was (workers inherit them);
``MONARCH_NB_FORKSERVER=0`` turns it off (workers are spawned, as Dask does by default).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading

PRELOAD = ["distributed", "torch", "monarch_nb.rank.engine"]
METHOD_KEY = "distributed.worker.multiprocessing-method"

_lock = threading.Lock()
_outputs: tuple = ()  # what fds 1 and 2 of this process were when ours started


def _server():
    from multiprocessing import forkserver

    return forkserver._forkserver  # the one forkserver of this process, multiprocessing's


def enabled() -> bool:
    return (
        os.environ.get("MONARCH_NB_FORKSERVER", "1") != "0"
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


def start() -> bool:
    """Start the forkserver, importing PRELOAD, unless one runs already; whether workers
    should be forked from it. Returns at once: the imports run while the scheduler starts."""
    global _outputs
    if not enabled():
        return False
    import dask

    # What each nanny puts in this process's environment before it starts a worker (so that
    # e.g. OMP_NUM_THREADS=1 is there before the interpreter starts): needed before the
    # forkserver starts and imports torch, for every worker forked from it.
    env = dask.config.get("distributed.nanny.pre-spawn-environ", default={}) or {}
    os.environ.update({k: str(v) for k, v in env.items()})
    server = _server()
    with _lock:
        running = getattr(server, "_forkserver_pid", None) is not None
        if running and _ours(server) and _outputs != _current_outputs():
            # A worker writes (outside cells) to the stdout and stderr it inherits: this
            # process's as they are now, as a spawned worker's are, not as they were when the
            # forkserver started (pytest's capfd, a redirected kernel).
            _let_go(server)
            running = False
        if not running:
            server.set_forkserver_preload(PRELOAD)
            server.ensure_running()
            _outputs = _current_outputs()
    # Dask sets its own preload list (importing it here, on the event loop) the first time it
    # forks a worker, unless told it has: ours stays, also for a forkserver started later.
    import distributed.utils

    distributed.utils._forkserver_preload_set = True
    return True


def _ours(server) -> bool:
    """Whether the forkserver imports what this module has it import (a user's own may
    import other things, and is left alone)."""
    return list(getattr(server, "_preload_modules", None) or ()) == PRELOAD


def _current_outputs() -> tuple:
    """What fds 1 and 2 of this process are (device and inode)."""
    found = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            found.append((st.st_dev, st.st_ino))
        except OSError:
            found.append(None)
    return tuple(found)


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
        with contextlib.suppress(OSError):
            os.close(alive)
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
    threading.Thread(target=_reap, args=(pid,), name="monarch-forkserver", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)
