"""The notebook's side of the actors: one mailbox per controller, the worker events that tell
it a process died, the failed broadcasts reported to it, and what it reports (dead actors,
calls still owed, ``close``). mesh.py's meshes send through it.
"""

from __future__ import annotations

import re
import threading
import weakref

from monarch_nb.actors import here, inbox, supervision
from monarch_nb.actors import output as actors_output
from monarch_nb.actors.here import current_host
from monarch_nb.actors.mailbox import Mailbox
from monarch_nb.actors.stops import stops
from monarch_nb.actors.wire import ActorError
from monarch_nb.actors.worker import PLUGIN_NAME, ActorPlugin
from monarch_nb.errors import ClusterError
from monarch_nb.errors import current as current_controller

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


# -- the controller's side: one mailbox per controller ---------------------------------------------
class _ControllerActors:
    def __init__(self, ctl):
        self.ctl = ctl
        keep = getattr(ctl, "kept", None) is not None  # actors outlive a kept cluster's kernel
        ctl.client.register_plugin(ActorPlugin(keep), name=PLUGIN_NAME)
        loop = ctl.client.loop.asyncio_loop
        self.mailbox = Mailbox(loop, ctl.client.connection_args, self._unsolicited)
        self.mailbox.death_watchers.append(self._died)
        self.broadcast_errors: list[ActorError] = []
        self._watched: set[str] = set()
        ctl.restart_hooks.append(self._restarting)
        ctl.closing_hooks["actors"], ctl.owing_hooks["actors"] = close, calls_owed

    def _restarting(self) -> None:
        """Every actor goes with its worker; forget the meshes (asked for: no failure to
        report), and say why to their handles."""
        self.mailbox.meshes.clear()
        for info in self.ctl.ranks:
            self.mailbox.mark_dead(info.address, RESTARTED)

    def _died(self, address: str, cause: str) -> None:
        """A worker process died: a failure of each Monarch-API mesh with an actor there."""
        for mesh, report in supervision.deaths(self.mailbox.meshes.values(), address, cause):
            supervision.unhandled(supervision.failure_of(report, "?", mesh.name, mesh))

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
        elif "port" in msg:  # a value for a Port opened here, from an actor
            inbox.deliver(msg)
        else:
            self._broadcast_failed(msg)

    def _broadcast_failed(self, msg: dict) -> None:
        """Kept in ``broadcast_errors()``, then unhandled_fault_hook's (supervision.py)."""
        host = next((i.host for i in self.ctl.ranks if i.rank == msg["r"]), "?")
        mesh = self.mailbox.meshes.get(msg.get("mid"))
        name = mesh.name if mesh is not None else msg.get("mid", "?").rsplit("-", 1)[0]
        failure = supervision.failure_of(msg, host, name, mesh)
        if failure.error is not None:  # a broadcast that raised, not a process that died
            del self.broadcast_errors[
                : max(0, len(self.broadcast_errors) - MAX_BROADCAST_ERRORS + 1)
            ]
            self.broadcast_errors.append(failure.error)
        supervision.unhandled(failure)


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


def _client_mailbox() -> Mailbox | None:
    """The current controller's mailbox, where a cluster is up (here.client_mailbox)."""
    ctl = current_controller()
    return None if ctl is None or ctl.closed else _controller_state(ctl).mailbox


here.client_mailbox = _client_mailbox
