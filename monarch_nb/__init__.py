"""monarch-nb: the notebook kernel as the single controller of Dask-managed GPU workers.

``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``; ``monarch_nb.up()`` and
``monarch_nb.connect()`` do the same from plain Python.
"""

from monarch_nb.actors import (
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
from monarch_nb.controller.controller import Controller
from monarch_nb.controller.handles import CellHandle
from monarch_nb.controller.results import (
    CellError,
    CellTimeout,
    RemoteError,
    UnserializableResult,
    ValueMesh,
)
from monarch_nb.controller.start import connect, up
from monarch_nb.controller.targets import TargetError, parse_targets
from monarch_nb.errors import ClusterError, current
from monarch_nb.notebook.bokeh_display import show
from monarch_nb.telemetry.metrics import history
from monarch_nb.telemetry.recorder import log

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
    from monarch_nb.notebook.magic import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from monarch_nb.notebook.magic import unload

    unload(ipython)
