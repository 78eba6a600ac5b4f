"""monarch-nb: the notebook kernel as the single controller of Dask-managed GPU workers.

``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``; ``monarch_nb.up()`` and
``monarch_nb.connect()`` do the same from plain Python.
"""

from .controller import CellHandle, ClusterError, Controller, connect, current, up
from .metrics import history, log
from .results import CellError, CellTimeout, RemoteError, UnserializableResult, ValueMesh
from .targets import TargetError, parse_targets

__all__ = [
    "CellError",
    "CellHandle",
    "CellTimeout",
    "ClusterError",
    "Controller",
    "RemoteError",
    "TargetError",
    "UnserializableResult",
    "ValueMesh",
    "connect",
    "current",
    "history",
    "load_ipython_extension",
    "log",
    "parse_targets",
    "unload_ipython_extension",
    "up",
]


def load_ipython_extension(ipython) -> None:
    from .magic import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magic import unload

    unload(ipython)
