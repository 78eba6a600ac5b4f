"""PyTorch-Monarch-style actors on the same worker processes as the ``%%monarch`` engines.

Names and semantics follow torchmonarch::

    from monarch_nb.actors import Actor, endpoint, proc_mesh, current_rank

    class Counter(Actor):
        def __init__(self, start):
            self.n = start

        @endpoint
        def incr(self, by=1):
            self.n += by
            return self.n

    mesh = proc_mesh()                          # the current cluster, {"hosts": H, "gpus": G}
    counters = mesh.spawn("counters", Counter, 10)
    counters.incr.call(5).get()                 # ValueMesh({0: 15, 1: 15})
    counters.slice(gpus=1).incr.call_one().get()
    await counters.incr.call()                  # in a notebook cell

Adverbs: ``call`` (a Future of a ValueMesh), ``call_one`` (a mesh of one actor), ``choose`` (the
actor with the fewest of this process's calls unanswered), ``stream`` (futures in arrival
order), ``broadcast`` (fire and forget; failures are printed on the controller and kept in
``broadcast_errors()``). Messages go straight from the caller to the actor's worker on plain
sockets, never through the task queue.

This module holds process and actor meshes, spawning and stopping; ``shape`` their dimensions
and slicing; ``caller`` the notebook's side (a mailbox per controller, what it reports);
``adverbs`` the adverbs; ``mailbox`` the caller's connections; ``transport`` the sockets of both
sides; ``wire`` futures and errors; ``worker`` the actors' side; ``actor`` what an actor sees.
PyTorch Monarch's own names (``monarch_nb.actor``) add ``hosts`` (this_host, this_proc),
``inprocess`` (actors in the caller's own process), ``ports`` and ``inbox`` (Channel, Port,
send), ``supervision`` (MeshFailure, __supervise__), ``rdma`` (RDMABuffer), ``here`` (which
host this process is) and ``value_mesh``/``extent`` (values by mesh point).
"""

from __future__ import annotations

import logging
import threading
import uuid

import cloudpickle

from monarch_nb.actors.actor import (
    Actor,
    Context,
    Instance,
    Point,
    context,
    current_rank,
    current_size,
    endpoint,
    plain_methods_of,
)
from monarch_nb.actors.adverbs import ActorEndpoint, NotAnEndpoint, gather, pack_args
from monarch_nb.actors.caller import (
    CLUSTER_DOWN,
    _controller_state,
    _local_mailbox,
    _require_controller,
    broadcast_errors,
    close,
    dead_actors,
)
from monarch_nb.actors.mailbox import Mailbox
from monarch_nb.actors.shape import Shaped, _dims_of, _Member
from monarch_nb.actors.wire import ActorError, Future, SupervisionError, sources
from monarch_nb.controller.stacks import ask as actor_stacks
from monarch_nb.dispatch.results import Interrupted
from monarch_nb.errors import ClusterError

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


# -- meshes: where they send from ---------------------------------------------------------------
class _Life:
    """What the handles of one mesh share, its slices included: whether it was stopped (and
    how), the actor meshes spawned through a process mesh, and their logging options."""

    __slots__ = ("logging", "spawned", "stopped")

    def __init__(self):
        self.stopped: str | None = None
        self.spawned: list[ActorMesh] = []
        self.logging: dict | None = None  # ProcMesh.logging_option's, for later spawns too


class _Mesh(Shaped):
    """A shape of cluster members, the mailbox that reaches them and the state its handles
    share. ``_points``: made through Monarch's API (monarch_nb.actor), whose ``call()`` gives
    values by mesh point rather than by cluster rank; slices and copies keep it."""

    _points = False
    _life: _Life | None = None

    def _inherit(self, other: _Mesh):
        self._points, self._life = other._points, other._life
        return self

    def _stopped(self) -> str | None:
        return self._life.stopped if self._life is not None else None

    @property
    def _mailbox(self) -> Mailbox:
        if self._box is None:
            self._box = _local_mailbox()
        box = self._box
        if box.close_cause.startswith("detached"):  # the notebook let go; the actors live on
            raise ClusterError(box.close_cause)
        if (
            box.loop is not None and box.loop.is_closed()
        ) or box.close_cause == CLUSTER_DOWN:  # the workers went with it
            raise ClusterError(
                "this mesh's cluster is down: start one with %monarch up, then spawn again on "
                "proc_mesh()"
            )
        if box.closed:
            raise ClusterError(
                f"{box.close_cause}: its actors are stopped; spawn them again on a new "
                "proc_mesh() to start again"
            )
        return box


# -- process meshes and spawning -----------------------------------------------------------------
class ProcMesh(_Mesh):
    """Worker processes of the cluster as a mesh; ``spawn`` puts one actor on each."""

    def _with(self, dims, positions) -> ProcMesh:
        return ProcMesh(self._members, dims, positions, self._box)._inherit(self)

    def spawn(self, name: str, actor_class: type, *args, **kwargs) -> ActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every process of this mesh; waits until
        all are built (an ``__init__`` that raises is reported with its rank)."""
        if self._stopped():
            raise RuntimeError(
                f"this ProcMesh was stopped ({self._stopped()}): spawn on a new one "
                "(this_host().spawn_procs(), or proc_mesh())"
            )
        if not isinstance(name, str) or not name:
            raise TypeError(f"spawn needs a name (a non-empty str) first, got {name!r}")
        if not (isinstance(actor_class, type) and issubclass(actor_class, Actor)):
            what = actor_class.__name__ if isinstance(actor_class, type) else repr(actor_class)
            raise TypeError(
                f"spawn needs a subclass of monarch_nb.actors.Actor; {what} is not one "
                "(add Actor to its bases)"
            )
        where = f"{actor_class.__name__}.__init__"
        sources.remember(actor_class)
        try:
            cls_blob = cloudpickle.dumps(actor_class, protocol=5)
        except Exception as e:
            raise TypeError(f"cannot send class {actor_class.__name__}: {e}") from None
        blob = pack_args(where, args, kwargs)
        mesh_id = f"{name}-{uuid.uuid4().hex[:12]}"
        base = {"op": "spawn", "mesh": mesh_id, "name": name, "cls": cls_blob, "args": blob}
        base.update(where=where, dims=list(self._dims.items()))
        if self._life is not None and self._life.logging is not None:
            base["logging"] = self._life.logging
        targets = self._targets()
        mesh = ActorMesh(
            name, mesh_id, actor_class, self._members, self._dims, self._positions, self._box
        )
        mesh._points, mesh._life = self._points, _Life()
        fut = gather(mesh, [{**base, "pt": i, "r": m.rank} for i, m in targets], where, None)
        try:
            fut.get()
        except KeyboardInterrupt:  # no actor outlives its handle
            mesh.stop()
            raise Interrupted(f"spawn of {name!r} interrupted; its actors were stopped") from None
        except BaseException:  # a failed __init__: the others stop too
            mesh.stop()
            raise
        self._mailbox.meshes[mesh_id] = mesh
        if self._life is not None:
            self._life.spawned.append(mesh)
        spawner = context().actor_instance
        if spawner.cluster_rank is not None:  # spawned by an actor: stopped when it stops
            spawner._children[mesh_id] = mesh
        return mesh

    def stop(self, reason: str = "stopped by client") -> Future:
        """Stop every actor spawned through this mesh (the processes are the cluster's, and
        stay); spawning on it afterwards is refused. A Future of None."""
        life = self._life if self._life is not None else _Life()
        self._life = life
        if life.stopped is None:
            life.stopped = f"ProcMesh.stop(): {reason}"
        stopping = [m for m in life.spawned if m._stopped() is None]
        for mesh in stopping:
            mesh._life.stopped = f"its ProcMesh was stopped: {reason}"
        return _all_of([m.stop() for m in stopping], "ProcMesh.stop()")

    async def logging_option(
        self,
        stream_to_client: bool = False,
        aggregate_window_sec: int | None = None,
        level: int = logging.INFO,
    ) -> None:
        """Whether what the actors spawned through this mesh print (and log, from ``level``
        up) is shown here (``stream_to_client``) or kept in their workers' logs. Lines come
        as they are printed, each tagged with its actor: ``aggregate_window_sec`` is accepted
        (torchmonarch collapses similar lines within it) and changes nothing."""
        if aggregate_window_sec is not None and not stream_to_client:
            raise ValueError(
                "aggregate_window_sec needs stream_to_client=True (it shapes what is streamed)"
            )
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"level takes a logging level (logging.INFO...), not {level!r}")
        life = self._life if self._life is not None else _Life()
        self._life = life
        life.logging = {"stream": bool(stream_to_client), "level": level}
        for mesh in life.spawned:
            if mesh._stopped() is None:
                await mesh._set_logging(life.logging)

    def __repr__(self) -> str:
        return f"<ProcMesh {self._describe_dims()}>"

    def __reduce__(self):
        _refuse_in_process(self, "this ProcMesh")
        return _rebuilt, (
            ProcMesh,
            (self._members, self._dims, self._positions, None),
            self._points,
        )


def _rebuilt(cls, args, points):
    mesh = cls(*args)
    mesh._points = points
    return mesh


def _refuse_in_process(mesh: _Mesh, what: str) -> None:
    if any(m.address.startswith("inproc://") for m in mesh._members):
        raise TypeError(
            f"{what} lives in this process (this_proc() of the notebook or script), which no "
            "other process can reach: spawn on the cluster's processes "
            "(this_host().spawn_procs()) to hand it to actors"
        )


def _all_of(futures: list[Future], describe: str) -> Future:
    """One Future for several: None once all are done, or the first error."""
    done = Future(describe)
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:
        done._finish(raw=None)

    def one(fut: Future) -> None:
        error = fut._error
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if error is not None:
            done._finish(error=error)
        elif last:
            done._finish(raw=None)

    for fut in futures:
        fut.add_done_callback(lambda fut=fut: one(fut))
    return done


def proc_mesh(ctl=None) -> ProcMesh:
    """The ranks of the current cluster (or ``ctl``'s) as a mesh, ``{"hosts": H, "gpus": G}``."""
    ctl = _require_controller(ctl)
    state = _controller_state(ctl)
    mesh = ProcMesh(_members_of(ctl, ctl.ranks), _dims_of(ctl.ranks), range(len(ctl.ranks)))
    mesh._box, mesh._life = state.mailbox, _Life()
    return mesh


def _members_of(ctl, ranks) -> list[_Member]:
    """The members for ``ranks`` of ``ctl``'s cluster, its mailbox told of their processes."""
    state = _controller_state(ctl)
    state.watch_scheduler()  # the ranks' addresses change on restart
    state.mailbox.know_workers({i.address: i.incarnation for i in ctl.ranks})
    return [_Member(i.rank, i.address, i.host, i.incarnation) for i in ranks]


# -- actor meshes ----------------------------------------------------------------------------------
_OWN = frozenset(
    ("_members", "_dims", "_positions", "_box", "_id", "_class_name", "_endpoints", "_methods")
)


class ActorMesh(_Mesh):
    """One actor per process of the mesh it was spawned on; ``mesh.ENDPOINT.ADVERB(...)``."""

    def __init__(self, name, mesh_id, actor_class, members, dims, positions, mailbox=None):
        super().__init__(members, dims, positions, mailbox)
        self.name = name
        self._id = mesh_id
        if isinstance(actor_class, tuple):  # rebuilt from a pickle
            self._class_name, self._endpoints, self._methods = actor_class
        else:
            self._class_name = actor_class.__name__
            self._endpoints = actor_class._monarch_endpoints
            self._methods = plain_methods_of(actor_class)

    def _with(self, dims, positions) -> ActorMesh:
        info = (self._class_name, self._endpoints, self._methods)
        mesh = ActorMesh(self.name, self._id, info, self._members, dims, positions, self._box)
        return mesh._inherit(self)

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in _OWN:  # before __init__ has set them (unpickling)
            raise AttributeError(attr)
        if attr in self._endpoints:
            return ActorEndpoint(self, attr)
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr in self._methods:
            return NotAnEndpoint(self, attr)
        known = ", ".join(sorted(self._endpoints)) or "none"
        raise AttributeError(f"{self._class_name} has no endpoint {attr!r} (endpoints: {known})")

    def stop(self, reason: str = "stopped by client") -> Future:
        """Stop these actors (their threads end; later calls fail)."""
        if self._life is not None and len(self._positions) == len(self._members):
            self._life.stopped = self._life.stopped or f"{self.name}.stop(): {reason}"
        base = {"op": "stop", "mesh": self._id, "where": f"{self._class_name}.stop"}
        msgs = [{**base, "pt": i, "r": m.rank} for i, m in self._targets()]
        self._forget_in(self._mailbox.meshes)
        self._forget_in(context().actor_instance._children)
        return gather(self, msgs, f"{self.name}.stop", lambda raw: None, stopping=True)

    def _set_logging(self, options: dict) -> Future:
        base = {"op": "logging", "mesh": self._id, "where": f"{self._class_name}.logging"}
        msgs = [{**base, **options, "pt": i, "r": m.rank} for i, m in self._targets()]
        return gather(self, msgs, f"{self.name}.logging_option", lambda raw: None)

    def stacks(self, native: bool = False):
        """The stacks of these actors' threads, and of their awaiting ``async`` endpoints
        (``%monarch stacks`` for this mesh): a StacksReport."""
        ranks = sorted({m.rank for _, m in self._targets()})
        return actor_stacks(_require_controller(), ranks, native, actor=self.name)

    def _forget_in(self, registry: dict) -> None:
        """Drop the mesh from ``registry`` once every actor of it is stopped (not for a slice)."""
        whole = registry.get(self._id)
        if whole is not None and set(whole._positions) <= set(self._positions):
            del registry[self._id]

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} of {self._class_name}, {self._describe_dims()}>"

    def __reduce__(self):
        _refuse_in_process(self, f"actor mesh {self.name!r}")
        info = (self._class_name, self._endpoints, self._methods)
        args = (self.name, self._id, info, self._members, self._dims, self._positions, None)
        return _rebuilt, (ActorMesh, args, self._points)
