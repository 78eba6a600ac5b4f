"""monarch-nb: the notebook kernel as the single controller of Dask-managed GPU workers.

``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``; ``monarch_nb.up()`` and
``monarch_nb.connect()`` do the same from plain Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from monarch_nb import errors as _errors

# Each public name and the module it comes from, imported when first used: a worker (and the
# forkserver it is forked from) imports this package for the engine and never needs the
# controller, the magics or IPython, which an eager import here gave every worker to import.
_EXPORTS = {
    "monarch_nb.actors": (
        "Actor",
        "ActorError",
        "ActorMesh",
        "Future",
        "ProcMesh",
        "SupervisionError",
        "context",
        "current_rank",
        "current_size",
        "endpoint",
        "proc_mesh",
    ),
    "monarch_nb.controller.controller": ("Controller",),
    "monarch_nb.dispatch.handles": ("CellHandle",),
    "monarch_nb.dispatch.results": (
        "CellError",
        "CellTimeout",
        "RemoteError",
        "UnserializableResult",
        "ValueMesh",
    ),
    "monarch_nb.controller.start": ("attach", "connect", "up"),
    "monarch_nb.actors.recover": ("actor_mesh",),
    "monarch_nb.dispatch.targets": ("TargetError", "parse_targets"),
    "monarch_nb.errors": ("ClusterError", "current"),
    "monarch_nb.notebook.bokeh_display": ("show",),
    "monarch_nb.rank.labels": ("label",),
    "monarch_nb.telemetry.metrics": ("history",),
    "monarch_nb.telemetry.recorder": ("log",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
# Modules used by their name (``monarch_nb.checkpoint.save(...)``), imported when first used too.
_MODULES = {"checkpoint": "monarch_nb.rank.checkpoint", "ft": "monarch_nb.rank.ft"}


def _widget_relay(send):
    """A controller's twins of its ranks' widgets (notebook/comm_relay.py), imported as the first
    controller is made: the controller's folder is below the notebook's (docs/architecture.md),
    and a worker, which imports this package too, never makes one."""
    from monarch_nb.notebook.comm_relay import CommRelay

    return CommRelay(send)


_errors.widget_relay = _widget_relay


def _show_profile(profile) -> None:
    """A profiled cell's timeline and numbers under it (notebook/profile_view.py)."""
    from monarch_nb.notebook.profile_view import show

    show(profile.analysis, profile.title, str(profile.directory))


_errors.show_profile = _show_profile

if TYPE_CHECKING:
    from monarch_nb.actors import (
        Actor,
        ActorError,
        ActorMesh,
        Future,
        ProcMesh,
        SupervisionError,
        context,
        current_rank,
        current_size,
        endpoint,
        proc_mesh,
    )
    from monarch_nb.actors.recover import actor_mesh
    from monarch_nb.controller.controller import Controller
    from monarch_nb.controller.start import attach, connect, up
    from monarch_nb.dispatch.handles import CellHandle
    from monarch_nb.dispatch.results import (
        CellError,
        CellTimeout,
        RemoteError,
        UnserializableResult,
        ValueMesh,
    )
    from monarch_nb.dispatch.targets import TargetError, parse_targets
    from monarch_nb.errors import ClusterError, current
    from monarch_nb.notebook.bokeh_display import show
    from monarch_nb.rank import checkpoint, ft
    from monarch_nb.rank.labels import label
    from monarch_nb.telemetry.metrics import history
    from monarch_nb.telemetry.recorder import log


def __getattr__(name: str):
    module = _WHERE.get(name)
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif module is None:
        raise AttributeError(f"module 'monarch_nb' has no attribute {name!r}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "CellError",
    "CellHandle",
    "CellTimeout",
    "ClusterError",
    "Controller",
    "Future",
    "ProcMesh",
    "RemoteError",
    "SupervisionError",
    "TargetError",
    "UnserializableResult",
    "ValueMesh",
    "actor_mesh",
    "attach",
    "checkpoint",
    "connect",
    "context",
    "current",
    "current_rank",
    "current_size",
    "endpoint",
    "ft",
    "history",
    "label",
    "load_ipython_extension",
    "log",
    "parse_targets",
    "proc_mesh",
    "show",
    "unload_ipython_extension",
    "up",
]


def load_ipython_extension(ipython) -> None:
    from monarch_nb.controller import forkserver

    forkserver.warm()  # first: the workers' imports run while the magics' do, and after
    from monarch_nb.notebook.magic import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from monarch_nb.controller import forkserver
    from monarch_nb.notebook.magic import unload

    unload(ipython)
    forkserver.release_unclaimed()
