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
sockets, never through the task queue. This module holds meshes and slicing; ``adverbs`` the
adverbs, ``mailbox`` the caller's connections, ``transport`` the sockets of both sides, ``wire``
futures and errors, ``worker`` the actors' side, ``actor`` what an actor sees.
"""

from __future__ import annotations

import contextvars
import itertools
import re
import sys
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import cloudpickle

from monarch_nb.actors import output as actors_output
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
from monarch_nb.actors.mailbox import Mailbox
from monarch_nb.actors.stops import stops
from monarch_nb.actors.wire import ActorError, Future, SupervisionError, decode_error, sources
from monarch_nb.actors.worker import PLUGIN_NAME, ActorPlugin, current_host
from monarch_nb.controller.stacks import ask as actor_stacks
from monarch_nb.dispatch.results import Interrupted
from monarch_nb.errors import ClusterError
from monarch_nb.errors import current as current_controller

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

MAX_BROADCAST_ERRORS = 100
# Why a controller's pending calls fail when its actor system closes: it went down, or
# actors.close() was called with the cluster still up.
CLUSTER_DOWN = "the cluster was shut down"
CLOSED = "the actor system was closed for this controller (actors.close())"
RESTARTED = "the workers were restarted (%monarch restart); spawn again on a new proc_mesh()"
# Why the scheduler removed a worker, from the id Dask gives the event
# ("handle-worker-cleanup-1796258544.84"): in words, for a SupervisionError.
REMOVED_BECAUSE = {
    "handle-worker-cleanup": "its connection to the scheduler closed",
    "check-worker-ttl": "it sent the scheduler no heartbeat for too long",
    "retire-workers": "it was retired as the cluster scaled down",
    "worker-close-gracefully": "it closed",
    "nanny-close": "its nanny closed",
    "client-restart": "the workers were restarted",
    "client-restart-workers": "the workers were restarted",
}


def removed_because(stimulus_id: str | None) -> str:
    """Why the scheduler removed a worker, from its event's ``stimulus_id``."""
    kind = re.sub(r"-[0-9.e+-]+$", "", stimulus_id or "")
    return REMOVED_BECAUSE.get(kind, f"Dask says {kind!r}" if kind else "no reason given")


class _Member(NamedTuple):
    rank: int  # the cluster rank of the worker
    address: str
    host: str
    incarnation: str = ""  # which worker process at that address (RankInfo.incarnation)


# -- the controller's side: one mailbox per controller ---------------------------------------------
class _ControllerActors:
    def __init__(self, ctl):
        self.ctl = ctl
        keep = getattr(ctl, "kept", None) is not None  # actors outlive a kept cluster's kernel
        ctl.client.register_plugin(ActorPlugin(keep), name=PLUGIN_NAME)
        loop = ctl.client.loop.asyncio_loop
        self.mailbox = Mailbox(loop, ctl.client.connection_args, self._unsolicited)
        self.broadcast_errors: list[ActorError] = []
        self._watched: set[str] = set()
        ctl.restart_hooks.append(self._restarting)
        ctl.closing_hooks["actors"], ctl.owing_hooks["actors"] = close, calls_owed

    def _restarting(self) -> None:
        """Every actor goes with its worker; say why, and forget the meshes."""
        for info in self.ctl.ranks:
            self.mailbox.mark_dead(info.address, RESTARTED)
        self.mailbox.meshes.clear()

    def watch_scheduler(self) -> None:
        """A worker the scheduler removes is dead even if its comm has not closed yet. Each
        worker has its own event topic (the "all" topic would also echo this client's own
        removal back to it while it closes)."""
        for info in self.ctl.ranks:
            if info.address not in self._watched:
                self._watched.add(info.address)
                self.ctl.client.subscribe_topic(info.address, self._on_worker_event(info.address))

    def _on_worker_event(self, address: str):
        def on_event(event) -> None:
            _, msg = event
            if isinstance(msg, dict) and msg.get("action") == "remove-worker":
                why = removed_because(msg.get("stimulus_id"))
                self.mailbox.mark_dead(address, f"the scheduler removed the worker: {why}")

        return on_event

    def _unsolicited(self, msg: dict) -> None:
        if "out" in msg:  # what actors printed
            actors_output.show(msg)
        elif "stopped" in msg:  # an endpoint reached pdb
            stops.note(msg["stopped"])
        else:
            self._broadcast_failed(msg)

    def _broadcast_failed(self, msg: dict) -> None:
        host = next((i.host for i in self.ctl.ranks if i.rank == msg["r"]), "?")
        err = decode_error(msg, host, f"broadcast to {msg['where']}")
        del self.broadcast_errors[: max(0, len(self.broadcast_errors) - MAX_BROADCAST_ERRORS + 1)]
        self.broadcast_errors.append(err)
        # In a fresh context: ipykernel 7 shows a thread's (or task's) output under the cell
        # its context came from, which here is the cell that spawned the mesh; without one the
        # line goes to the cell running now.
        contextvars.Context().run(print, f"monarch_nb: {err.args[0]}", file=sys.stderr, flush=True)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _controller_state(ctl) -> _ControllerActors:
    with _states_lock:
        state = _states.get(ctl)
        if state is None:
            state = _states[ctl] = _ControllerActors(ctl)
        return state


def _require_controller(ctl=None):
    ctl = ctl if ctl is not None else current_controller()
    if ctl is None and current_host() is not None:
        raise ClusterError(
            "proc_mesh() is the notebook's: inside an actor, spawn on a ProcMesh passed in as "
            "an argument (to __init__ or an endpoint)"
        )
    if ctl is None or ctl.closed:
        raise ClusterError(
            "no cluster is up: start one with %monarch up (or monarch_nb.up()) first"
        )
    return ctl


def _local_mailbox() -> Mailbox:
    """Where a mesh reference sends from: this worker's mailbox inside an actor, else the
    current controller's."""
    host = current_host()
    if host is not None:
        return host.mailbox
    return _controller_state(_require_controller()).mailbox


# -- shapes and slicing ----------------------------------------------------------------------------
class _Mesh:
    """Members of the cluster arranged in named dimensions; a slice keeps the full member list
    and the positions it selects, in row-major order of ``extent``."""

    def __init__(self, members, dims: Mapping[str, int], positions, mailbox: Mailbox | None):
        self._members: tuple[_Member, ...] = tuple(members)
        self._dims = dict(dims)
        self._positions: tuple[int, ...] = tuple(positions)
        self._box = mailbox

    @property
    def _mailbox(self) -> Mailbox:
        if self._box is None:
            self._box = _local_mailbox()
        box = self._box
        if box.close_cause.startswith("detached"):  # the notebook let go; the actors live on
            raise ClusterError(box.close_cause)
        if box.loop.is_closed() or box.close_cause == CLUSTER_DOWN:  # the workers went with it
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

    @property
    def extent(self) -> dict[str, int]:
        return dict(self._dims)

    sizes = extent

    def size(self, dim: str | None = None) -> int:
        if dim is None:
            return len(self._positions)
        if dim not in self._dims:
            raise ValueError(f"unknown dimension {dim!r}; this mesh has {self._describe_dims()}")
        return self._dims[dim]

    def __len__(self) -> int:
        return len(self._positions)

    def _describe_dims(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._dims.items()) or "no dimensions"

    def _targets(self) -> list[tuple[int, _Member]]:
        """(position in this slice, member) for every actor this mesh addresses."""
        return [(i, self._members[p]) for i, p in enumerate(self._positions)]

    def slice(self, **selection):
        """``mesh.slice(gpus=slice(0, 2))`` keeps a dimension; ``mesh.slice(hosts=0)`` drops it."""
        unknown = [k for k in selection if k not in self._dims]
        if unknown:
            raise ValueError(
                f"cannot slice by {', '.join(map(repr, unknown))}: this mesh has dimensions "
                f"{self._describe_dims()}"
            )
        picks, dims = [], {}
        for name, size in self._dims.items():
            sel = selection.get(name, slice(None))
            if isinstance(sel, slice):
                chosen = list(range(*sel.indices(size)))
                if not chosen:
                    raise IndexError(f"{name}={_show(sel)} selects nothing (size {size})")
                dims[name] = len(chosen)
            elif isinstance(sel, int) and not isinstance(sel, bool):
                if not -size <= sel < size:
                    raise IndexError(f"{name}={sel} is out of range 0..{size - 1}")
                chosen = [sel % size]
            else:
                raise TypeError(f"{name}= takes an int or a slice, not {type(sel).__name__}")
            picks.append(chosen)
        sizes = list(self._dims.values())
        positions = []
        for index in itertools.product(*picks):
            flat = 0
            for i, size in zip(index, sizes, strict=True):
                flat = flat * size + i
            positions.append(self._positions[flat])
        return self._with(dims, positions)


def _show(sel: slice) -> str:
    parts = ["" if x is None else str(x) for x in (sel.start, sel.stop, sel.step)]
    return ":".join(parts[:2] if sel.step is None else parts)


def _dims_of(ranks) -> dict[str, int]:
    """{"hosts": H, "gpus": G} when every host holds G consecutive ranks, else {"ranks": N}."""
    hosts: list[str] = []
    for info in ranks:
        if not hosts or hosts[-1] != info.host:
            hosts.append(info.host)
    per_host = len(ranks) // len(hosts)
    if len(set(hosts)) == len(hosts) and per_host * len(hosts) == len(ranks):
        counts = [sum(1 for i in ranks if i.host == h) for h in hosts]
        if all(c == per_host for c in counts):
            return {"hosts": len(hosts), "gpus": per_host}
    return {"ranks": len(ranks)}


# -- process meshes and spawning -------------------------------------------------------------------
class ProcMesh(_Mesh):
    """The cluster's worker processes as a mesh; ``spawn`` puts one actor on each."""

    def _with(self, dims, positions) -> ProcMesh:
        return ProcMesh(self._members, dims, positions, self._box)

    def spawn(self, name: str, actor_class: type, *args, **kwargs) -> ActorMesh:
        """Construct ``actor_class(*args, **kwargs)`` on every process of this mesh; waits until
        all are built (an ``__init__`` that raises is reported with its rank)."""
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
        targets = self._targets()
        mesh = ActorMesh(
            name, mesh_id, actor_class, self._members, self._dims, self._positions, self._box
        )
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
        spawner = context().actor_instance
        if spawner.cluster_rank is not None:  # spawned by an actor: stopped when it stops
            spawner._children[mesh_id] = mesh
        return mesh

    def __repr__(self) -> str:
        return f"<ProcMesh {self._describe_dims()}>"

    def __reduce__(self):
        return ProcMesh, (self._members, self._dims, self._positions, None)


def proc_mesh(ctl=None) -> ProcMesh:
    """The ranks of the current cluster (or ``ctl``'s) as a mesh, ``{"hosts": H, "gpus": G}``."""
    ctl = _require_controller(ctl)
    state = _controller_state(ctl)
    state.watch_scheduler()  # the ranks' addresses change on restart
    state.mailbox.know_workers({i.address: i.incarnation for i in ctl.ranks})
    members = [_Member(i.rank, i.address, i.host, i.incarnation) for i in ctl.ranks]
    return ProcMesh(members, _dims_of(ctl.ranks), range(len(members)), state.mailbox)


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
        return ActorMesh(self.name, self._id, info, self._members, dims, positions, self._box)

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

    def stop(self) -> Future:
        """Stop these actors (their threads end; later calls fail)."""
        base = {"op": "stop", "mesh": self._id, "where": f"{self._class_name}.stop"}
        msgs = [{**base, "pt": i, "r": m.rank} for i, m in self._targets()]
        self._forget_in(self._mailbox.meshes)
        self._forget_in(context().actor_instance._children)
        return gather(self, msgs, f"{self.name}.stop", lambda raw: None)

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
        info = (self._class_name, self._endpoints, self._methods)
        return ActorMesh, (
            self.name,
            self._id,
            info,
            self._members,
            self._dims,
            self._positions,
            None,
        )


# -- what the controller reports -------------------------------------------------------------------
def dead_actors(ctl=None) -> list[tuple[str, int, str]]:
    """``(mesh name, cluster rank, cause)`` for every actor spawned from this controller whose
    worker process died or was removed; ``%monarch status`` shows these."""
    ctl = ctl if ctl is not None else current_controller()
    state = _states.get(ctl) if ctl is not None else None
    if state is None:
        return []
    dead = []
    for mesh in list(state.mailbox.meshes.values()):
        for _, member in mesh._targets():
            cause = state.mailbox.cause_of(member.address, member.incarnation)
            if cause is not None:
                dead.append((mesh.name, member.rank, cause))
    return sorted(dead, key=lambda d: (d[0], d[1]))


def calls_owed(ctl, addresses) -> int:
    """How many replies this controller's actor calls (and spawns) still wait for from the
    workers at ``addresses``: ``%monarch scale`` lets them arrive before those workers go."""
    state = _states.get(ctl)
    if state is None:
        return 0
    mailbox = state.mailbox
    with mailbox._lock:
        owed = [a for p in mailbox._pending.values() for a in p.targets.values()]
    return sum(a in addresses for a in owed)


def close(ctl=None, cause: str | None = None) -> None:
    """Drop this controller's actor connections (call before leaving a cluster you keep
    running): the workers stop the actors it spawned, its pending calls fail, and its meshes
    refuse further use. ``proc_mesh()`` starts afresh."""
    ctl = ctl if ctl is not None else current_controller()
    with _states_lock:
        state = _states.pop(ctl, None) if ctl is not None else None
    if state is not None:
        state.mailbox.close(cause or (CLUSTER_DOWN if ctl.closed else CLOSED))


def broadcast_errors(ctl=None, clear: bool = False) -> list[ActorError]:
    """Failures of ``broadcast()`` calls reported to this controller (the last 100)."""
    ctl = ctl if ctl is not None else current_controller()
    state = _states.get(ctl) if ctl is not None else None
    if state is None:
        return []
    errors = list(state.broadcast_errors)
    if clear:
        state.broadcast_errors.clear()
    return errors
