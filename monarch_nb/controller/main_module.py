"""Dask's worker processes started without importing the user's ``__main__`` script again.

multiprocessing starts a process by spawn, or from its forkserver, with "preparation data"
(``multiprocessing.spawn.get_preparation_data``) from which the child first imports the parent's
main script, as ``__mp_main__``, then unpickles what to run. A script with code at its top level
(no ``if __name__ == "__main__":``, as PyTorch Monarch's scripts are written) would run that
code again in every worker, ``up()`` included, starting workers of its own.

Nothing a rank runs needs the script: what the controller sends from ``__main__`` (a function, a
class, an instance) travels by value (cloudpickle), and what the nanny starts is Dask's own. So
the processes Dask's nanny starts for its workers, known by the name it gives them, are prepared
without the main script; any other process (the user's own pools, a DataLoader's workers) is
left as multiprocessing makes it.
"""

from __future__ import annotations

import functools
import threading
from multiprocessing import spawn

# distributed.nanny's name for the process of its worker (its AsyncProcess's)
WORKER_PROCESS = "Dask Worker process (from Nanny)"
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")  # what has the child import it

_lock = threading.Lock()


def install() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` (looked up there by spawn's and the
    forkserver's Popen as each process starts), once in this process: the worker processes
    that Dask's nanny starts from then on leave the main script alone."""
    with _lock:
        if getattr(spawn.get_preparation_data, "_monarch_nb", False):
            return
        spawn.get_preparation_data = _without_main(spawn.get_preparation_data)


def _without_main(original):
    @functools.wraps(original)
    def get_preparation_data(name):
        data = original(name)
        if name == WORKER_PROCESS:
            for key in _MAIN_KEYS:
                data.pop(key, None)
        return data

    get_preparation_data._monarch_nb = True
    return get_preparation_data
