"""PyTorch-Monarch-style actors on the same worker processes as the ``%%monarch`` engines.

The caller's side (``mesh.py``, ``caller.py``, ``adverbs.py``, ``wire.py``) runs in the
controller's process; ``worker.py`` and ``actor.py`` run in the workers, ``output.py`` on both.
``monarch_nb.actor`` gives them PyTorch Monarch's names (mesh.py's docstring lists the rest).
"""

from monarch_nb.actors import mesh
from monarch_nb.actors.mesh import *  # noqa: F403 (the public names: mesh.__all__)

__all__ = mesh.__all__
