"""PyTorch-Monarch-style actors on the same worker processes as the ``%%monarch`` engines.

The caller's side (``mesh.py``, ``adverbs.py``, ``wire.py``) runs in the controller's process;
``worker.py`` and ``actor.py`` run in the workers, ``output.py`` on both.
"""

from monarch_nb.actors.mesh import (
    Actor,
    ActorError,
    ActorMesh,
    Context,
    Future,
    Instance,
    Point,
    ProcMesh,
    SupervisionError,
    broadcast_errors,
    close,
    context,
    current_rank,
    current_size,
    dead_actors,
    endpoint,
    proc_mesh,
)

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "Context",
    "Future",
    "Instance",
    "Point",
    "ProcMesh",
    "SupervisionError",
    "broadcast_errors",
    "close",
    "context",
    "current_rank",
    "current_size",
    "dead_actors",
    "endpoint",
    "proc_mesh",
]
