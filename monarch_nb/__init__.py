"""monarch-nb: the notebook kernel as the single controller of Dask-managed GPU workers.

``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``; ``monarch_nb.up()`` and
``monarch_nb.connect()`` do the same from plain Python.
"""

from .actors import (
    Actor,
    ActorError,
    ActorMesh,
    ProcMesh,
    SupervisionError,
    context,
    current_rank,
    current_size,
    endpoint,
    proc_mesh,
)
from .bokeh_display import show
from .controller import CellHandle, ClusterError, Controller, current
from .metrics import history, log
from .results import CellError, CellTimeout, RemoteError, UnserializableResult, ValueMesh
from .start import connect, up
from .targets import TargetError, parse_targets

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "CellError",
    "CellHandle",
    "CellTimeout",
    "ClusterError",
    "Controller",
    "ProcMesh",
    "RemoteError",
    "SupervisionError",
    "TargetError",
    "UnserializableResult",
    "ValueMesh",
    "connect",
    "context",
    "current",
    "current_rank",
    "current_size",
    "endpoint",
    "history",
    "load_ipython_extension",
    "log",
    "parse_targets",
    "proc_mesh",
    "show",
    "unload_ipython_extension",
    "up",
]


def load_ipython_extension(ipython) -> None:
    from .magic import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magic import unload

    unload(ipython)
