"""The adverbs of an endpoint on an actor mesh: ``call``, ``call_one``, ``choose``, ``stream``,
``broadcast``, and how their messages and replies are packed and gathered."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import cloudpickle

from monarch_nb.actors.extent import Extent
from monarch_nb.actors.mailbox import Pending
from monarch_nb.actors.value_mesh import ValueMesh as PointMesh
from monarch_nb.actors.wire import ActorError, Future, MeshStopped, SupervisionError, decode_error
from monarch_nb.dispatch.results import ValueMesh

_EMPTY_ARGS = cloudpickle.dumps(((), {}), protocol=5)


def pack_args(what: str, args: tuple, kwargs: dict) -> bytes:
    if not args and not kwargs:
        return _EMPTY_ARGS
    try:
        return cloudpickle.dumps((args, kwargs), protocol=5)
    except Exception:
        bad = []
        for i, value in enumerate(args):
            if not _picklable(value):
                bad.append(f"argument {i} ({type(value).__name__})")
        for name, value in kwargs.items():
            if not _picklable(value):
                bad.append(f"{name}= ({type(value).__name__})")
        which = ", ".join(bad) or "the arguments together"
        raise TypeError(f"cannot send {what}: {which} cannot be pickled") from None


def _picklable(value: Any) -> bool:
    try:
        cloudpickle.dumps(value, protocol=5)
        return True
    except Exception:
        return False


class NotAnEndpoint:
    """Stands for a method without ``@endpoint``: any use says how to fix it."""

    def __init__(self, mesh, name: str):
        self._text = (
            f"{mesh._class_name}.{name} is not an endpoint; decorate it with @endpoint to "
            "call it through a mesh"
        )

    def _fail(self, *args, **kwargs):
        raise TypeError(self._text)

    __call__ = call = call_one = choose = stream = broadcast = _fail


class ActorEndpoint:
    """``mesh.NAME``: the adverbs that send a message to the mesh's actors."""

    def __init__(self, mesh, name: str):
        self._mesh = mesh
        self._name = name
        self._where = f"{mesh._class_name}.{name}"

    def __call__(self, *args, **kwargs):
        raise TypeError(
            f"{self._where} is an endpoint: call it with an adverb, e.g. "
            f"{self._mesh.name}.{self._name}.call(...).get()"
        )

    def _messages(self, targets, args, kwargs) -> list[dict]:
        mesh = self._mesh
        blob = pack_args(f"the arguments of {self._where}", args, kwargs)
        base = {"op": "send", "mesh": mesh._id, "ep": self._name, "where": self._where}
        base.update(args=blob, dims=list(mesh._dims.items()))
        return [{**base, "pt": i, "r": m.rank} for i, m in targets]

    def call(self, *args, **kwargs) -> Future:
        """Every actor of the mesh; a Future of a ValueMesh keyed by cluster rank, whose
        ``item(gpus=i)`` is the i-th actor of this mesh (of a reversed slice, too)."""
        mesh = self._mesh
        targets = mesh._targets()
        msgs = self._messages(targets, args, kwargs)
        dims, order = mesh._dims, [m.rank for _, m in targets]
        if mesh._points:  # Monarch's API: by mesh point, in the order of the mesh's positions
            extent = Extent(dims, dims.values())
            return gather(
                mesh, msgs, self._where, lambda raw: PointMesh(extent, [raw[r] for r in order])
            )
        return gather(mesh, msgs, self._where, lambda raw: ValueMesh(raw, dims or None, order))

    def call_one(self, *args, **kwargs) -> Future:
        """The only actor of a mesh of one (slice first); a Future of its value."""
        n = len(self._mesh)
        if n != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one actor; {self._mesh.name} has {n} "
                f"({self._mesh._describe_dims()}): slice it first, or use call()"
            )
        msgs = self._messages(self._mesh._targets(), args, kwargs)
        return gather(self._mesh, msgs, self._where, lambda raw: next(iter(raw.values())))

    def choose(self, *args, **kwargs) -> Future:
        """One actor, the one with the fewest calls from this process still unanswered (by
        any adverb but ``broadcast``, which has no answer); ties take turns. Calls other
        processes (other actors) made are not counted. A Future of its value."""
        msgs = self._messages([self._pick()], args, kwargs)
        return gather(self._mesh, msgs, self._where, lambda raw: next(iter(raw.values())))

    def _pick(self):
        """The (position, member) choose() sends to."""
        mesh = self._mesh
        box = mesh._mailbox
        targets = mesh._targets()
        start = next(_rotation) % len(targets)
        order = targets[start:] + targets[:start]
        alive = [t for t in order if box.cause_of(t[1].address, t[1].incarnation) is None]
        return min(alive or order, key=lambda t: box.inflight[(mesh._id, mesh._positions[t[0]])])

    def stream(self, *args, **kwargs) -> Iterator[Future]:
        """Every actor; yields one Future per actor, resolved in the order replies arrive."""
        mesh = self._mesh
        _check_alive(mesh, [])  # a stopped mesh, in one line
        msgs = self._messages(mesh._targets(), args, kwargs)
        hosts = {m.rank: m.host for m in mesh._members}

        def decode(reply):
            return _load(reply, hosts.get(reply["r"], "?"), self._where)

        futures = [
            Future(f"{self._where} (reply {k + 1} of {len(msgs)})", decode)
            for k in range(len(msgs))
        ]
        arrived = itertools.count()

        def on_reply(rank, reply):
            fut = futures[next(arrived)]
            if reply["ok"]:
                fut._finish(raw=reply)
            else:
                fut._finish(error=decode_error(reply, hosts.get(rank, "?"), self._where))

        def on_lost(rank, address, cause):
            futures[next(arrived)]._finish(error=SupervisionError(mesh.name, rank, address, cause))

        box, alive = mesh._mailbox, []
        for m in msgs:  # an actor known to be dead answers at once
            member = mesh._members[mesh._positions[m["pt"]]]
            cause = box.cause_of(member.address, member.incarnation)
            if cause is None:
                alive.append(m)
            else:
                on_lost(member.rank, member.address, cause)
        if alive:
            _send(mesh, alive, on_reply, on_lost)
        return iter(futures)

    def broadcast(self, *args, **kwargs) -> None:
        """Every actor, without waiting; a failure is reported to the controller (printed there
        and kept in ``broadcast_errors()``), never lost."""
        mesh = self._mesh
        msgs = self._messages(mesh._targets(), args, kwargs)
        _check_alive(mesh, msgs)
        # No reply, so no bookkeeping either: an acknowledgement per actor (which choose()
        # could count) halved the rate of broadcasts (benchmarks/bench_actors.py)
        mesh._mailbox.send([(mesh._members[mesh._positions[m["pt"]]].address, m) for m in msgs])


_rotation = itertools.count()


def _check_alive(mesh, msgs: list[dict], stopping: bool = False) -> None:
    stopped = None if stopping else mesh._stopped()
    if stopped is not None:
        first = mesh._members[mesh._positions[0]]
        raise MeshStopped(getattr(mesh, "name", "?"), first.rank, first.address, stopped)
    box = mesh._mailbox
    for m in msgs:
        member = mesh._members[mesh._positions[m["pt"]]]
        cause = box.cause_of(member.address, member.incarnation)
        if cause is not None:
            raise SupervisionError(getattr(mesh, "name", "?"), member.rank, member.address, cause)


def _send(mesh, msgs: list[dict], on_reply, on_lost) -> None:
    addresses = {m["r"]: mesh._members[mesh._positions[m["pt"]]].address for m in msgs}
    keys = {m["r"]: (mesh._id, mesh._positions[m["pt"]]) for m in msgs}
    mesh._mailbox.send(
        [(addresses[m["r"]], m) for m in msgs], Pending(addresses, on_reply, on_lost, keys)
    )


def _load(reply: dict, host: str, where: str) -> Any:
    """The value of one reply. One that cannot be unpickled here (say, of a class only the
    workers can import) is that rank's failure, named like any other."""
    if reply["v"] is None:
        return None
    try:
        return cloudpickle.loads(reply["v"])
    except Exception as e:
        evalue = f"the return value cannot be unpickled by the caller: {e}"
        raise ActorError(reply["r"], host, type(e).__name__, evalue, [], where, e) from None


def gather(mesh, msgs: list[dict], where: str, decode, stopping: bool = False) -> Future:
    """A Future of every reply: ``decode({rank: value})``, or the first error by rank."""
    hosts = {m.rank: m.host for m in mesh._members}
    name = getattr(mesh, "name", "?")
    try:
        _check_alive(mesh, msgs, stopping)
    except SupervisionError as e:
        return Future.failed(where, e)

    def finish(raw: dict[int, dict]):
        errors = [decode_error(r, hosts.get(k, "?"), where) for k, r in raw.items() if not r["ok"]]
        if errors:
            raise min(errors, key=lambda e: e.rank)
        values = {k: _load(r, hosts.get(k, "?"), where) for k, r in sorted(raw.items())}
        return values if decode is None else decode(values)

    fut = Future(where, finish)  # decoded on the caller's thread, not the comm's event loop
    replies: dict[int, dict] = {}
    lock = threading.Lock()

    def on_reply(rank, reply):
        with lock:
            replies[rank] = reply
            if len(replies) == len(msgs):
                fut._finish(raw=dict(replies))

    def on_lost(rank, address, cause):
        # At once, without waiting for the other ranks: a dead rank will never answer.
        fut._finish(error=SupervisionError(name, rank, address, cause))

    _send(mesh, msgs, on_reply, on_lost)
    return fut
