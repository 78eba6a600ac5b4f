"""Failures that reach a mesh's owner, PyTorch Monarch's way: an actor's ``__supervise__``
first, for meshes it spawned, then the owner above it, and at the top, in the notebook or
script, ``monarch_nb.actor.unhandled_fault_hook``.

A failure is a ``MeshFailure``: a broadcast whose endpoint raised (a call's error goes to the
one who waits for it, as an ``ActorError``). ``__supervise__(failure)`` runs on the owning
actor's thread (an ``async def`` one on its loop): a truthy return handles it; a falsy one, or
no ``__supervise__``, passes it up; one that raises passes it up with what it raised.

The hook at the top is looked up on ``monarch_nb.actor`` when a failure arrives, so a script
may replace it, as Monarch's examples do. The default prints the failure and goes on (the
notebook's kernel must outlive a failed broadcast; torchmonarch's default exits). A hook that
raises leaves the failure unhandled: it is printed, and the main thread gets a
KeyboardInterrupt, as torchmonarch does.
"""

from __future__ import annotations

import contextvars
import inspect
import signal
import sys
import threading

from monarch_nb.actors import inbox
from monarch_nb.actors import output as actors_output
from monarch_nb.actors.actor import Context, _context
from monarch_nb.actors.stops import stops
from monarch_nb.actors.wire import decode_error


class MeshFailure:
    """A failure on a mesh: which mesh (``mesh_name``), which of its actors (``rank``, the
    cluster rank) and what happened (``report()``, also its ``str``)."""

    def __init__(self, mesh_name: str, rank: int | None, reason: str, error=None, mesh=None):
        self.mesh_name = mesh_name
        self.rank = rank
        self.reason = reason
        self.error = error  # the ActorError, where an endpoint raised
        self.mesh = mesh  # the mesh's handle, where its owner holds one

    def report(self) -> str:
        return self.reason

    def __str__(self) -> str:
        return self.reason

    def __repr__(self) -> str:
        return f"MeshFailure(mesh_name={self.mesh_name!r}, rank={self.rank}, {self.reason!r})"

    def __reduce__(self):
        return MeshFailure, (self.mesh_name, self.rank, self.reason, self.error)


def default_fault_hook(failure: MeshFailure) -> None:
    """Print the failure and go on (``monarch_nb.actor.unhandled_fault_hook``'s default)."""
    # In a fresh context: ipykernel 7 shows a thread's output under the cell its context came
    # from (here, the cell that spawned the mesh); without one, under the cell running now.
    contextvars.Context().run(print, f"monarch_nb: {failure}", file=sys.stderr, flush=True)


def _hook():
    module = sys.modules.get("monarch_nb.actor")
    return getattr(module, "unhandled_fault_hook", default_fault_hook)


def unhandled(failure: MeshFailure) -> None:
    """A failure nobody below handled, at the notebook or script: the hook decides."""
    try:
        _hook()(failure)
    except BaseException as e:  # SystemExit from sys.exit too: unhandled
        print(
            f"monarch_nb: unhandled failure ({type(e).__name__} from unhandled_fault_hook): "
            f"{failure}",
            file=sys.stderr,
            flush=True,
        )
        # A SIGINT, not _thread.interrupt_main(): that one waits for a blocking call to return
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def failure_of(msg: dict, host: str, mesh_name: str, mesh=None) -> MeshFailure:
    """The failure a report describes: a broadcast that raised, or (``dead``) a process that
    died under one of the mesh's actors."""
    if "dead" in msg:
        reason = f"actor mesh {mesh_name!r} rank {msg['r']} is dead: {msg['dead']}"
        return MeshFailure(mesh_name, msg["r"], reason, None, mesh)
    err = decode_error(msg, host, f"broadcast to {msg['where']}")
    return MeshFailure(mesh_name, msg["r"], err.args[0], err, mesh)


def deaths(meshes, address: str, cause: str) -> list[tuple]:
    """``(mesh, report)`` for each actor of a Monarch-API mesh (monarch_nb.actor's) whose
    process at ``address`` died; monarch_nb's own meshes say so at their next call instead
    (SupervisionError), and in ``%monarch status``."""
    found = []
    for mesh in meshes:
        if not mesh._points or mesh._stopped():
            continue
        for _, member in mesh._targets():
            if member.address == address:
                found.append((mesh, {"r": member.rank, "mid": mesh._id, "dead": cause}))
    return found


def reached_client(msg: dict, host: str) -> None:
    """What this process's own actors (this_proc()) report unasked."""
    if "port" in msg:
        inbox.deliver(msg)
    elif "out" in msg:
        actors_output.show(msg)
    elif "stopped" in msg:
        stops.note(msg["stopped"])
    else:
        unhandled(failure_of(msg, host, _name_of(msg["mid"])))


def _name_of(mesh_id: str) -> str:
    return mesh_id.rsplit("-", 1)[0]  # ids are f"{name}-{12 hex digits}" (mesh.py)


# -- on a worker: the actor that spawned the failed mesh ------------------------------------------
def in_actor(runner, msg: dict) -> None:
    """A failure of a mesh ``runner``'s actor spawned: its ``__supervise__`` decides, on its
    own thread; what it does not handle goes to its owner."""
    supervise = getattr(type(runner.actor), "__supervise__", None)
    if supervise is None:
        _pass_up(runner, msg)
        return
    child = runner.instance._children.get(msg["mid"])
    failure = failure_of(msg, "?", getattr(child, "name", _name_of(msg["mid"])), child)

    def run() -> None:
        token = _context.set(Context(runner.instance, runner.instance.rank))
        try:
            if inspect.iscoroutinefunction(supervise):
                task = runner.loop.create_task(supervise(runner.actor, failure))
                task.add_done_callback(lambda t: _settle(runner, msg, t))
                return
            with runner._plain_code():
                handled = supervise(runner.actor, failure)
        except BaseException as e:  # a supervisor's failure goes up with it
            _pass_up(runner, _raised(msg, runner, e))
            return
        finally:
            _context.reset(token)
        if not handled:
            _pass_up(runner, msg)

    try:
        runner.loop.call_soon_threadsafe(run)
    except RuntimeError:  # that actor has stopped: its owner hears of it
        _pass_up(runner, msg)


def _settle(runner, msg: dict, task) -> None:
    if task.cancelled():
        _pass_up(runner, msg)
    elif task.exception() is not None:
        _pass_up(runner, _raised(msg, runner, task.exception()))
    elif not task.result():
        _pass_up(runner, msg)


def _raised(msg: dict, runner, exc: BaseException) -> dict:
    cls = type(runner.actor).__name__
    also = f" (and {cls}.__supervise__ raised {type(exc).__name__}: {exc})"
    if "dead" in msg:
        return {**msg, "dead": msg["dead"] + also}
    e = dict(msg["e"])
    e["evalue"] += also
    return {**msg, "e": e}


def _pass_up(runner, msg: dict) -> None:
    runner.owner.send({**msg, "mid": runner._id})  # the next hop finds its own mesh
