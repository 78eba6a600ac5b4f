"""What every part of the package may import: the cluster error, the current controller and
the maker of a controller's widget relay.

Nothing here imports the rest of the package, so the import graph stays one-way: the
controller, the actors, ``log()`` and the magics meet here rather than in each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The current controller: a controller/controller.py Controller, whose folder is above this one.
_current: Any = None

# Makes a controller's twins of its ranks' widgets from ``send(rank, msg) -> bool`` (the
# notebook folder's CommRelay): the controller sits below the notebook folder and cannot import
# it, so monarch_nb/__init__.py, which runs before any of the package's modules, puts it here.
widget_relay: Callable[[Callable[[int, dict], bool]], Any] | None = None
# Shows a profiled cell's timeline under it (notebook/profile_view.py), put here the same way.
show_profile: Callable[[Any], None] | None = None


class ClusterError(RuntimeError):
    """A cluster could not be made, joined or used; the message says what to do."""

    def _render_traceback_(self) -> list[str]:  # IPython: the one line, without our frames
        return [f"ClusterError: {self}"]


def current() -> Any:
    """The controller that ``%%monarch`` cells and ``log()`` use: the last made by ``up()`` or
    ``connect()``, until its ``down()``."""
    return _current


def set_current(ctl: Any) -> None:
    global _current
    _current = ctl
