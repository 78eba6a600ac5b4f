"""What every part of the package may import: the cluster error and the current controller.

Nothing here imports the rest of the package, so the import graph stays one-way: the
controller, the actors, ``log()`` and the magics meet here rather than in each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from monarch_nb.controller.controller import Controller

_current: Controller | None = None


class ClusterError(RuntimeError):
    """A cluster could not be made, joined or used; the message says what to do."""

    def _render_traceback_(self) -> list[str]:  # IPython: the one line, without our frames
        return [f"ClusterError: {self}"]


def current() -> Controller | None:
    """The controller that ``%%monarch`` cells and ``log()`` use: the last made by ``up()`` or
    ``connect()``, until its ``down()``."""
    return _current


def set_current(ctl: Controller | None) -> None:
    global _current
    _current = ctl
