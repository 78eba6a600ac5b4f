"""PyTorch Monarch's low-level messaging: ``Channel.open()`` gives a ``Port`` and its
``PortReceiver``; ``send(endpoint, args, kwargs, port=...)`` has every actor answer to a port; an
endpoint marked ``explicit_response_port=True`` answers through the port it is handed.

A Port is a small picklable address; where its value goes depends on where it was opened:

- in this process: straight into the receiver's queue;
- in a worker (an actor opened it): as an ``op: "port"`` message to that worker's address,
  through the sender's mailbox, like any actor message;
- in the notebook (or a script): the notebook reaches the workers, not the other way round, so
  a worker sends the value back on the connection the notebook keeps to it (the one the
  notebook's mailbox, named ``target``, opened), which is how replies travel too.

A reply port (``explicit_response_port``) is the answer to one call: its value is that call's
reply, on the caller's connection.
"""

from __future__ import annotations

import collections
import threading
import types
import uuid
from typing import Any

import cloudpickle

from monarch_nb.actors import here, inbox
from monarch_nb.actors.wire import Future, SupervisionError, _error, decode_error

PROCESS = uuid.uuid4().hex  # tells this process's own ports from others'
GONE = "this Port's receiver is gone ({why}): open a new Channel and send to its port"


class PortClosedError(RuntimeError):
    """A value sent to a Port whose receiver no longer takes any."""


class Port:
    """Where values for one ``PortReceiver`` (or one call's answer) are sent: ``send(value)``
    and ``exception(error)``, from any thread of any process that has it."""

    # Port[int] and the like in annotations, as torchmonarch's code writes them
    __class_getitem__ = classmethod(types.GenericAlias)

    def __init__(self, port_id, origin, address=None, target=None, rank=None, reply=None):
        self._id = port_id
        self._origin = origin  # PROCESS of the process that opened it
        self._address = address  # that process's actor address, where it is a worker
        self._target = target  # the id of that process's mailbox, for the way back
        self._rank = rank  # the sender's place in its mesh, for ranked receivers
        self._reply = reply  # (call id, rank) for a call's answer
        self._channel = None  # a reply port in the process that got the call: its connection
        self._done = False

    # -- sending ------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Send ``obj`` to the receiver (fire and forget, in order with this port's others)."""
        try:
            blob = cloudpickle.dumps(obj, protocol=5)
        except Exception as e:
            raise TypeError(f"cannot send {type(obj).__name__} to a Port: {e}") from None
        self._deliver({"ok": True, "v": blob})

    def exception(self, obj: BaseException) -> None:
        """Make the receiver's ``recv().get()`` (or the call's ``get()``) raise ``obj``."""
        self._deliver(_error(obj))

    def _deliver(self, body: dict, rank: int | None = None) -> None:
        if self._reply is not None:
            self._answer(body)
            return
        msg = {**body, "port": self._id, "r": self._rank if rank is None else rank}
        if self._origin == PROCESS:
            receiver = inbox.receivers.get(self._id)
            if receiver is None:
                raise PortClosedError(GONE.format(why="its PortReceiver was dropped or closed"))
            receiver._put(msg)
            return
        _route(msg, self._address, self._target)

    def _answer(self, body: dict) -> None:
        """A reply port: the call's one answer, on the connection of its caller."""
        call_id, rank = self._reply
        if call_id is None:  # a broadcast's: nobody waits for an answer
            return
        if self._done:
            raise PortClosedError("this call was answered already: a response port takes one value")
        self._done = True
        msg = {**body, "id": call_id, "r": rank}
        if self._channel is not None:
            if self._channel.closed:
                raise PortClosedError(GONE.format(why="the caller's process is gone"))
            self._channel.send(msg)
            return
        _route(msg, None, self._target)

    def __reduce__(self):
        where = (self._address, self._target, self._rank, self._reply)
        return _rebuild, (self._id, self._origin, *where)

    def __repr__(self) -> str:
        kind = "reply port" if self._reply is not None else "Port"
        return f"<{kind} {self._id[:8] if self._id else self._reply[0][:8]}>"


def _rebuild(port_id, origin, address, target, rank, reply) -> Port:
    return Port(port_id, origin, address, target, rank, reply)


def reply_port(channel, msg: dict) -> Port:
    """The Port an ``explicit_response_port`` endpoint is handed for the call ``msg``."""
    if "id" not in msg:  # a broadcast
        return Port(None, PROCESS, reply=(None, msg["r"]))
    port = Port(None, PROCESS, target=channel.caller, reply=(msg["id"], msg["r"]))
    port._channel = channel
    return port


def _route(msg: dict, address: str | None, target: str | None) -> None:
    """Send ``msg`` to the process that opened the port, from another one."""
    host = here.current_host()
    if address is not None:  # a worker's: reachable by any process through its mailbox
        box = here.sending_mailbox()
        cause = box.cause_of(address) if box is not None else "no cluster is up here"
        if cause is not None:
            raise PortClosedError(GONE.format(why=f"its process is gone: {cause}"))
        box.send([(address, {"op": "port", **msg})])
        return
    wire = getattr(host, "_wire", None) if host is not None else None
    channel = wire.channels.get(target) if wire is not None and target else None
    if channel is None or channel.closed:
        raise PortClosedError(
            GONE.format(why="the notebook (or script) that opened it is not connected here")
        )
    channel.send(msg)


def send(endpoint, args: tuple = (), kwargs: dict | None = None, port=None, selection="all"):
    """Send ``endpoint``'s message to every actor of its mesh (``selection="all"``) or to one
    (``"choose"``), without waiting; with ``port``, each actor's answer (or error) is sent to
    it, ranked by the actor's place in the mesh."""
    from monarch_nb.actors import adverbs

    if not isinstance(endpoint, adverbs.ActorEndpoint):
        raise TypeError(
            f"send takes an endpoint of an actor mesh (mesh.NAME), not {type(endpoint).__name__}"
        )
    if selection not in ("all", "choose"):
        raise ValueError(f"selection is 'all' or 'choose', not {selection!r}")
    if port is not None and not isinstance(port, Port):
        raise TypeError(f"port takes a Port (from Channel.open()), not {type(port).__name__}")
    mesh = endpoint._mesh
    targets = mesh._targets() if selection == "all" else [endpoint._pick()]
    msgs = endpoint._messages(targets, tuple(args), dict(kwargs or {}))
    adverbs._check_alive(mesh, msgs)
    if port is None:
        mesh._mailbox.send([(mesh._members[mesh._positions[m["pt"]]].address, m) for m in msgs])
        return
    places = {m["r"]: m["pt"] for m in msgs}

    def on_reply(rank, reply) -> None:
        _forward(port, {k: reply[k] for k in ("ok", "v", "e") if k in reply}, places[rank])

    def on_lost(rank, address, cause) -> None:
        lost = SupervisionError(getattr(mesh, "name", "?"), rank, address, cause)
        _forward(port, _error(lost), places[rank])

    adverbs._send(mesh, msgs, on_reply, on_lost)


def _forward(port: Port, body: dict, rank: int) -> None:
    """An answer on to ``port``, on the mailbox's reader thread, which must not raise."""
    try:
        port._deliver(body, rank)
    except PortClosedError as e:
        import sys

        print(f"monarch_nb: an answer for send(..., port=...) was dropped: {e}", file=sys.stderr)


# -- receiving ----------------------------------------------------------------------------------
class PortReceiver:
    """The receiving end of a Channel: ``recv()`` is a Future of the next value, in the order
    sent. It stops receiving when dropped or ``close()``d."""

    # Port[int] and the like in annotations, as torchmonarch's code writes them
    __class_getitem__ = classmethod(types.GenericAlias)

    def __init__(self, port_id: str, once: bool):
        self._id = port_id
        self._once = once
        self._lock = threading.Lock()
        self._arrived: collections.deque[dict] = collections.deque()
        self._waiting: collections.deque[Future] = collections.deque()
        inbox.receivers[port_id] = self

    def recv(self) -> Future:
        """A Future of the next value (``.get()``, or ``await`` it)."""
        fut = Future("a value on this Channel", self._decode)
        with self._lock:
            if self._arrived:
                msg = self._arrived.popleft()
            else:
                self._waiting.append(fut)
                return fut
        fut._finish(raw=msg)
        return fut

    def ranked(self) -> RankedPortReceiver:
        ranked = RankedPortReceiver.__new__(RankedPortReceiver)
        ranked.__dict__.update(self.__dict__)
        inbox.receivers[self._id] = ranked
        return ranked

    def close(self) -> None:
        """Take no more values: a later ``send`` to its port is refused."""
        inbox.receivers.pop(self._id, None)

    def _put(self, msg: dict) -> None:
        with self._lock:
            if self._once:
                inbox.receivers.pop(self._id, None)
            if self._waiting:
                fut = self._waiting.popleft()
            else:
                self._arrived.append(msg)
                return
        fut._finish(raw=msg)

    def _decode(self, msg: dict) -> Any:
        if not msg["ok"]:
            error = decode_error(msg, "?", "a value sent to a Port")
            raise error.exception if isinstance(error.exception, BaseException) else error
        return cloudpickle.loads(msg["v"]) if msg["v"] is not None else None

    def __reduce__(self):
        raise TypeError(
            "a PortReceiver stays in the process that opened its Channel; send its Port instead"
        )


class RankedPortReceiver(PortReceiver):
    """Like PortReceiver, but each value comes as ``(rank of the sender, value)``."""

    def _decode(self, msg: dict) -> tuple[int | None, Any]:
        return msg.get("r"), super()._decode(msg)


class Channel:
    """``port, receiver = Channel.open()``: a Port to hand to actors, and where its values
    arrive; ``once=True`` takes a single value."""

    # Port[int] and the like in annotations, as torchmonarch's code writes them
    __class_getitem__ = classmethod(types.GenericAlias)

    @staticmethod
    def open(once: bool = False) -> tuple[Port, PortReceiver]:
        port_id = uuid.uuid4().hex
        address, target = _where_opened()
        return Port(port_id, PROCESS, address, target), PortReceiver(port_id, once)

    @staticmethod
    def open_ranked(once: bool = False) -> tuple[Port, RankedPortReceiver]:
        port, receiver = Channel.open(once)
        return port, receiver.ranked()


def _where_opened() -> tuple[str | None, str | None]:
    """(this worker's actor address, None) in a worker; (None, the id of the mailbox the
    notebook's cluster connections use) in the notebook, where a cluster is up."""
    host = here.current_host()
    if host is not None:
        return host.worker.address, None
    box = here.client_mailbox()
    return None, box.id if box is not None else None
