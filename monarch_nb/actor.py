"""PyTorch Monarch's actor API by its own names: code written for ``monarch.actor`` runs with
``monarch_nb.actor`` in its imports, on the cluster's workers (docs/actors.md has a row for
every name: same, different and how, or absent and why).

    from monarch_nb.actor import Actor, endpoint, this_host

    class Trainer(Actor):
        @endpoint
        def train(self, step: int): ...

    procs = this_host().spawn_procs(per_host={"gpus": 2})   # ranks of the cluster (started if none)
    trainers = procs.spawn("trainers", Trainer)
    trainers.train.call(step=0).get()                        # a ValueMesh keyed by mesh point

Values come back by mesh point, as in torchmonarch; monarch_nb's own ``proc_mesh()`` (in
``monarch_nb.actors``) keeps its values by cluster rank. A script needs no ``__main__`` guard:
the workers never import it, and what they run reaches them by value.
"""

from __future__ import annotations

import functools

from monarch_nb.actors.actor import Actor, Context, Point, context, current_rank, current_size
from monarch_nb.actors.actor import endpoint as endpoint
from monarch_nb.actors.adverbs import ActorEndpoint as Endpoint
from monarch_nb.actors.extent import Extent
from monarch_nb.actors.hosts import HostMesh, this_host, this_proc
from monarch_nb.actors.mesh import ActorMesh, ProcMesh
from monarch_nb.actors.ports import Channel, Port, PortClosedError, PortReceiver, send
from monarch_nb.actors.supervision import MeshFailure, default_fault_hook
from monarch_nb.actors.value_mesh import ValueMesh
from monarch_nb.actors.wire import ActorError, Future, MeshStopped, SupervisionError

# Called with a MeshFailure nobody handled; replace it (monarch_nb.actor.unhandled_fault_hook =
# ...) as in torchmonarch. The default prints the failure and goes on; one that raises leaves it
# unhandled: the main thread gets a KeyboardInterrupt (actors/supervision.py).
unhandled_fault_hook = default_fault_hook


def current_actor_name() -> str:
    """The name of the running actor's mesh ("client" outside any actor)."""
    return context().actor_instance.name


class Accumulator:
    """``Accumulator(mesh.endpoint, identity, combine).accumulate(*args)``: a Future of the
    endpoint's answers from every actor, folded with ``combine`` from ``identity``."""

    def __init__(self, endpoint: Endpoint, identity, combine):
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args, **kwargs) -> Future:
        answers = self._endpoint.call(*args, **kwargs)
        folded = Future(f"{self._endpoint._where} accumulated")

        def fold() -> None:
            try:
                values = answers.get(0).values()
                folded._finish(raw=functools.reduce(self._combine, values, self._identity))
            except BaseException as e:  # the caller's get() raises it
                folded._finish(error=e)

        answers.add_done_callback(fold)
        return folded


__all__ = [
    "Accumulator",
    "Actor",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Context",
    "Endpoint",
    "Extent",
    "Future",
    "HostMesh",
    "MeshFailure",
    "MeshStopped",
    "Point",
    "Port",
    "PortClosedError",
    "PortReceiver",
    "ProcMesh",
    "SupervisionError",
    "ValueMesh",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "send",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
